"""The Space's logic, kept out of app.py (the thin Gradio page): `check` plans a job, `jobs` runs a merge job,
`local` is `make run` (a local Hub with demo repos; never deployed)."""
