"""The Space's logic, kept out of app.py (the thin Gradio page): `check` plans a job, `merge_job` runs a merge job,
`convert_job` a conversion, `deploy` publishes the Space, `local` is `make run` (a local Hub with demo repos; never
deployed) with the tiny pipelines of `demo_pipelines`."""
