"""The Hugging Face Hub, as the engine and the jobs above it see it: where inputs come from, where outputs go.

`client` (every Hub call: retries, one-line errors), `sources` (parse a source, pin it to a commit, fetch it into
the HF cache), `remote_headers` (a Hub model as sparse stand-ins holding only its real safetensors headers),
`publish` (one commit or a pull request, never an empty repo), `card` (the model card). The pipelined push that
uses them is `converter.jobs`.
"""
