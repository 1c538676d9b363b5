"""The node's dispatcher inside an API server: ``runner`` runs one engine request, ``pool`` picks
its engine (``balance``, ``prefix_index``, ``lora``) and ``engine_client`` talks to it;
``admission`` bounds what the server takes on, ``evacuation`` tallies what an engine's failure
moved, and ``metrics`` counts it all. Nothing here reads or writes a request body."""
