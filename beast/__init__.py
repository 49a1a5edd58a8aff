"""Shared pieces of MonoBeast and PolyBeast: the parts a researcher edits."""
