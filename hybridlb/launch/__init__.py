"""Launchers: start a node's components, wait until they are ready, tear them down."""
