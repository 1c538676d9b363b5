"""What a checkpoint says, read without torch: where it is (``path``), its architecture
(``spec``), its tokenizer, chat template and sampling defaults, and the incremental
detokenizer. The API server uses only this side; engines load the weights with
``hybridlb.model``."""
