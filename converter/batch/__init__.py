"""`converter batch`: many independent convert / merge+push / verify jobs on Ray, resumable, with a report.

Each job runs the ordinary `converter` CLI in a subprocess of a Ray task, so a batch job behaves exactly like the
same command typed by hand (same checks, same one-line errors, same PR reuse), and a crash or a kill takes down one
job, never the batch. Modules: `job_list` (the job list), `state` (SQLite: what is done), `run` (the Ray side),
`report` (the table); the command's arguments are converter.cli.batch.
"""
