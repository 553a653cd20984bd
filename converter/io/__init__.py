"""The bottom layer: bytes, files and threads, knowing nothing of models or adapters.

`safetensors_header` (the one header codec), `safetensors_file` (a safetensors file read by byte range, or front to
back once), `dtypes` (the one dtype table), `units` (byte sizes for people), `scratch` (temp folders that say whose
they are), `records` (the files written next to a merged model), `progress`, `background` (a worker thread),
`readahead` (reads ahead of the math), `lazy` (torch imported on first use), `optional` (a missing extra, in one line).
"""
