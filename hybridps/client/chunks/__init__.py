"""Chunks as data: the chunk, its tensor and chunk states, the layout of params into chunks,
and the store that holds them. The bottom wing: it imports no other part of the client."""
