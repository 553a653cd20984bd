"""The converter Space: merge LoRA adapters into their base model, verify the result, push it to your account.

A thin Gradio front end: every decision lives in the `converter` package (`converter.app.check` plans a job,
`converter.app.jobs` runs it). Run it with `python app.py` (on a Space), or `make run` for the offline demo
against a local Hub. Every Hub call of a job uses the signed-in user's token; the token never reaches a log.
"""

from __future__ import annotations

import os

# Before gradio/huggingface_hub are imported (they read these at import time): no analytics, and never send an
# implicit token (a Space secret) with a request; a job passes the signed-in user's token explicitly.
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import html  # noqa: E402
import logging  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import gradio as gr  # noqa: E402

from converter.app.check import Limits, check, describe_adapter, describe_base  # noqa: E402
from converter.app.jobs import (  # noqa: E402
    DTYPES,
    STAGES,
    JobRequest,
    default_repo,
    parse_adapters,
    public_paths,
    redactor,
    run_job,
)
from converter.errors import ConverterError  # noqa: E402
from converter.scratch import startup_cleanup, temp_folder  # noqa: E402
from converter.sources import job_sources  # noqa: E402
from converter.units import human_bytes  # noqa: E402

log = logging.getLogger("converter.app")
CONCURRENCY = int(os.environ.get("CONVERTER_APP_CONCURRENCY", "1"))
QUEUE_SIZE = int(os.environ.get("CONVERTER_APP_QUEUE_SIZE", "8"))
WORKROOT = os.environ.get("CONVERTER_APP_WORKDIR") or None
SIGN_IN = "Sign in with Hugging Face (button above) first: the job downloads and uploads with your account."

INTRO = """# 🧬 LoRA merge
Fold LoRA adapters into their base model **exactly** (float32 math, one rounding per weight), **prove** the merged
model behaves like base + adapters (PEFT's unmerged forward), and publish a clean safetensors repo with an honest
model card, to your account, in one commit. Nothing is created on the Hub until the upload, so a failed job leaves
no empty repo."""


def _fail(err: BaseException, token: str | None = None) -> gr.Error:
    """A readable, escaped one-line error for the page; unexpected ones are logged (token-free) for the operator."""
    clean = redactor(token)
    if isinstance(err, ConverterError):
        return gr.Error(html.escape(clean(str(err))), title="Cannot do that", print_exception=False)
    log.error("unexpected failure:\n%s", clean("".join(traceback.format_exception(err))))
    return gr.Error(
        html.escape(f"unexpected failure ({type(err).__name__}); this is a bug in converter, please report it"),
        title="Error",
        print_exception=False,
    )


def _token(oauth_token: gr.OAuthToken | None) -> str:
    if oauth_token is None or not oauth_token.token:
        raise ConverterError(SIGN_IN)
    return oauth_token.token  # only ever passed on, never formatted (OAuthToken's repr prints it)


def show_user(profile: gr.OAuthProfile | None) -> str:
    if profile is None:
        return "🔒 Not signed in. " + SIGN_IN
    return f"✅ Signed in as **{html.escape(profile.username)}**; merged models go to your account by default."


def base_info(base: str | None, oauth_token: gr.OAuthToken | None) -> str:
    """Checked as you type: exists, has a config, size and architecture."""
    base = (base or "").strip()
    if "/" not in base or base.endswith("/"):
        return ""
    try:
        token = _token(oauth_token)
        with temp_folder("base") as tmp, job_sources(Path(tmp) / "cache"):
            info = describe_base(base, token, Path(tmp) / "standin")
    except ConverterError as e:
        return f"❌ {html.escape(str(e))}"
    return (
        f"✅ `{info['pinned']}`: {info['architecture']}, {info['parameters'] / 1e6:,.1f} M parameters, "
        f"{human_bytes(info['size'])} of weights"
    )


def adapters_info(adapters: str | None, oauth_token: gr.OAuthToken | None) -> str:
    """Each adapter's format and rank, once detected."""
    adapters = adapters or ""
    try:
        token = _token(oauth_token)
        specs = parse_adapters(adapters)
    except ConverterError as e:
        return f"❌ {html.escape(str(e))}" if adapters.strip() else ""
    lines = []
    with temp_folder("adapter") as tmp, job_sources(Path(tmp) / "cache"):
        for spec in specs:
            try:
                a = describe_adapter(spec.source, token)
                lines.append(
                    f"✅ `{a['pinned']}` × {spec.weight}: {a['format']}, rank {a['rank']}, alpha {a['alpha']}"
                    f"{', DoRA' if a['dora'] else ''}, {a['tensors']} tensors"
                    + (f", trained on `{html.escape(a['trained_on'])}`" if a["trained_on"] else "")
                )
            except ConverterError as e:
                lines.append(f"❌ {html.escape(str(e))}")
    return "\n\n".join(lines)


def suggest_repo(base: str, adapters: str, profile: gr.OAuthProfile | None):
    user = profile.username if profile is not None else "you"
    return gr.update(placeholder=default_repo(user, base or "", adapters or ""))


def _request(base, adapters, repo, dtype, qlora, verify, prompts, private, create_pr, profile) -> JobRequest:
    base, adapters, repo, prompts = (str(x or "") for x in (base, adapters, repo, prompts))  # empty boxes: None
    repo = repo.strip() or default_repo(profile.username, base, adapters)
    return JobRequest(
        base=base,
        adapters=adapters,
        repo_id=repo,
        dtype=dtype,
        qlora_base=qlora,
        verify=verify,
        prompts=prompts,
        private=private,
        create_pr=create_pr,
    )


def check_job(
    base, adapters, repo, dtype, qlora, verify, prompts, private, create_pr,
    profile: gr.OAuthProfile | None, oauth_token: gr.OAuthToken | None,
) -> str:  # fmt: skip
    """The plan before the work: formats, coverage, bytes to download and write, warnings."""
    token = None
    try:
        token = _token(oauth_token)
        request = _request(base, adapters, repo, dtype, qlora, verify, prompts, private, create_pr, profile)
        with temp_folder("check") as tmp, job_sources(Path(tmp) / "cache"):
            try:
                report = check(request.recipe(), token, Path(tmp) / "standin", Limits.from_env())
                plan = public_paths(report.markdown(), tmp)
            except ConverterError as e:  # the page names Hub repos, never where the server keeps them
                e.args = (public_paths(str(e), tmp),)
                raise
    except Exception as e:  # noqa: BLE001 - every failure becomes a readable message
        raise _fail(e, token) from None
    return f"### Plan → `{html.escape(request.repo_id)}`\n\n" + plan


def run(
    base, adapters, repo, dtype, qlora, verify, prompts, private, create_pr,
    profile: gr.OAuthProfile | None, oauth_token: gr.OAuthToken | None, progress=gr.Progress(),  # noqa: B008 - gradio's way
):  # fmt: skip
    """The job, as a generator: the live log streams while it runs; the result replaces it at the end."""
    token = None
    try:
        token = _token(oauth_token)
        request = _request(base, adapters, repo, dtype, qlora, verify, prompts, private, create_pr, profile)
        request.recipe()  # bad input fails here, before the job takes a worker
    except Exception as e:  # noqa: BLE001
        raise _fail(e, token) from None
    lines: list[str] = []
    state: dict = {"stage": "queued"}

    def work() -> None:
        try:
            state["result"] = run_job(
                request,
                token,
                workroot=WORKROOT,
                limits=Limits.from_env(),
                stage=lambda name: state.update(stage=name),
                log=lines.append,
            )
        except BaseException as e:  # noqa: BLE001 - handed to the page below
            state["error"] = e

    worker = threading.Thread(target=work, name="converter-job", daemon=True)
    worker.start()
    skip = (gr.skip(),) * 4
    while worker.is_alive():
        worker.join(0.5)
        stage = state["stage"]
        if stage in STAGES:
            progress(STAGES.index(stage) / len(STAGES), desc=f"{stage} ({STAGES.index(stage) + 1}/{len(STAGES)})")
        yield ("\n".join(lines), *skip)
    if "error" in state:
        lines.append(f"error: {redactor(token)(str(state['error']))}")
        yield ("\n".join(lines), *skip)
        raise _fail(state["error"], token)
    result = state["result"]
    link = result.pr_url or result.url
    what = "Pull request opened" if result.pr_url else ("Pushed" if result.changed else "Already up to date")
    summary = f"### ✅ {what}: [{html.escape(result.repo_id)}]({link})\n\n" + (
        f"commit `{result.commit}`" if result.commit else ""
    )
    report = result.report
    verification = report["markdown"] if report else "**Not verified** (verification was switched off)."
    generations = [[g["prompt"], g["base"], g["reference"], g["merged"]] for g in (report or {}).get("generations", [])]
    yield ("\n".join(lines), summary, verification, generations, result.card)


def build() -> gr.Blocks:
    with gr.Blocks(title="LoRA merge (converter)") as demo:
        gr.Markdown(INTRO)
        with gr.Row():
            gr.LoginButton(min_width=250)
            user = gr.Markdown(elem_id="user")
        with gr.Row():
            with gr.Column():
                base = gr.Textbox(
                    label="Base model (Hub id)", placeholder="org/name or org/name@revision", elem_id="base"
                )
                base_status = gr.Markdown(elem_id="base-status")
                adapters = gr.Textbox(
                    label="Adapters: one per line, `org/name[@revision][/file.safetensors] [weight]`",
                    placeholder="someone/my-lora\nsomeone/other-lora 0.5",
                    lines=3,
                    elem_id="adapters",
                )
                adapter_status = gr.Markdown(elem_id="adapter-status")
                repo = gr.Textbox(label="Target repo (empty: the suggestion shown)", elem_id="repo")
                with gr.Row():
                    private = gr.Checkbox(label="Private repo", value=False)
                    create_pr = gr.Checkbox(label="Open as a pull request (repo already has a model)", value=False)
                with gr.Accordion("Options", open=False):
                    dtype = gr.Dropdown(list(DTYPES), value="keep", label="Output dtype (keep: each tensor's own)")
                    qlora = gr.Dropdown(
                        ["original", "dequantized"],
                        value="original",
                        label="QLoRA adapters: merge into the original weights, or their 4-bit dequantized view",
                    )
                    verify = gr.Checkbox(label="Verify against base + adapters (PEFT, unmerged)", value=True)
                    prompts = gr.Textbox(label="Verification prompts, one per line (empty: built-in set)", lines=3)
                with gr.Row():
                    check_btn = gr.Button("Check", elem_id="check")
                    run_btn = gr.Button("Merge, verify and push", variant="primary", elem_id="run")
            with gr.Column():
                plan = gr.Markdown(elem_id="plan")
                result = gr.Markdown(elem_id="result")
                logbox = gr.Textbox(label="Log", lines=12, max_lines=20, autoscroll=True, elem_id="log")
        with gr.Accordion("Verification", open=True):
            verification = gr.Markdown(elem_id="verification")
            generations = gr.Dataframe(
                headers=["prompt", "base", "base + adapters (PEFT)", "merged"],
                label="Greedy generations, side by side",
                wrap=True,
                elem_id="generations",
            )
        with gr.Accordion("Model card preview", open=False):
            card = gr.Markdown(elem_id="card")

        form = [base, adapters, repo, dtype, qlora, verify, prompts, private, create_pr]
        demo.load(show_user, outputs=user, queue=False)
        base.change(base_info, inputs=base, outputs=base_status, queue=False, api_visibility="private")
        adapters.change(adapters_info, inputs=adapters, outputs=adapter_status, queue=False, api_visibility="private")
        for box in (base, adapters):
            box.change(suggest_repo, inputs=[base, adapters], outputs=repo, queue=False, api_visibility="private")
        check_btn.click(check_job, inputs=form, outputs=plan, api_name="check", concurrency_id="check")
        run_btn.click(
            run,
            inputs=form,
            outputs=[logbox, result, verification, generations, card],
            api_name="run",
            concurrency_limit=CONCURRENCY,
            concurrency_id="job",
        )
    return demo


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("httpx", "httpx2"):  # one INFO line per HTTP request
        logging.getLogger(noisy).setLevel(logging.WARNING)
    startup_cleanup(WORKROOT, log.info)  # job folders and HF caches of a previous (killed) process
    build().queue(max_size=QUEUE_SIZE, default_concurrency_limit=CONCURRENCY).launch()


if __name__ == "__main__":
    main()
