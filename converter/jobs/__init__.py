"""Whole jobs, as every front end runs them: merge → proofs → card → one commit, and the verbs built on them.

`pipeline` (`push`: the Hub job, pipelined when it merges; `verify_folder`), `streaming` (its machinery: the base
streamed in while the merge reads it, output shards uploaded as they are finished), `describe` (`inspect`: what a
model or an adapter is, from headers), `demo` (a complete merge offline on a tiny model), `convert` (`convert()` for
Python callers: the adapter formats and llama.cpp's GGUF adapter, which sit in different layers).
"""
