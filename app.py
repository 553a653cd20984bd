"""The converter Space: merge LoRA adapters into their base model (LLMs and diffusion pipelines), verify the
result, push it to your account; or convert a LoRA (kohya, LyCORIS, diffusers, PEFT, ComfyUI) to another format.

A thin Gradio front end: every decision lives in the `converter` package (`converter.app.check` plans a job,
`converter.app.merge_job` runs it, `converter.app.convert_job` runs a conversion). Run it with `python app.py` (on a
Space), or `make run` for the offline demo against a local Hub. Every Hub call of a job uses the signed-in user's
token; the token never reaches a log.
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

from converter.errors import MissingExtraError, UsageError  # noqa: E402
from converter.io.optional import require  # noqa: E402

try:
    gr = require("gradio", "the converter app")
except MissingExtraError as e:  # run as a script: the one line, no traceback
    raise SystemExit(f"error: {e}") from None

from converter.app.check import check, describe_adapter, describe_base, space_machine, weight_text  # noqa: E402
from converter.app.convert_job import ConvertRequest, default_convert_repo, run_convert  # noqa: E402
from converter.app.merge_job import (  # noqa: E402
    DTYPES,
    GGUF_CHOICES,
    STAGES,
    JobRequest,
    default_repo,
    parse_adapters,
    public_paths,
    redactor,
    run_job,
)
from converter.conversion.core import TARGETS  # noqa: E402
from converter.errors import ConverterError  # noqa: E402
from converter.hub.sources import job_sources  # noqa: E402
from converter.io.scratch import startup_cleanup, temp_folder  # noqa: E402
from converter.io.units import human_bytes  # noqa: E402
from converter.verification import VerificationReport, markdown  # noqa: E402

log = logging.getLogger("converter.app")
CONCURRENCY = int(os.environ.get("CONVERTER_APP_CONCURRENCY", "1"))
QUEUE_SIZE = int(os.environ.get("CONVERTER_APP_QUEUE_SIZE", "8"))
WORKROOT = os.environ.get("CONVERTER_APP_WORKDIR") or None
SIGN_IN = "Sign in with Hugging Face (button above) first: the job downloads and uploads with your account."

INTRO = """# 🧬 LoRA merge
Fold LoRA adapters (PEFT, kohya, LyCORIS, diffusers) into their base model, an LLM or a diffusion pipeline,
**exactly** (float32 math, one rounding per weight), **prove** the merged model behaves like base + adapters (the
adapters applied unmerged by PEFT or diffusers), and publish a clean safetensors repo with an honest model card, to
your account, in one commit; or **convert a LoRA** to another format, as a pull request on its repo. Nothing is
created on the Hub until the upload, so a failed job leaves no empty repo."""
CONVERT_INTRO = """Convert a LoRA file to another format **without merging** (each module keeps its rank and alpha):
kohya ↔ diffusers ↔ PEFT ↔ ComfyUI, for SD/SDXL, FLUX.1/2/3, Qwen-Image, Z-Image, Wan, HunyuanVideo, LTX, HiDream,
Lumina, Krea 2, Anima, MiniMax-H3 and more. With a base, module names are looked up in it (its headers only are
read): give one to move a file between a family's original names (kohya, ComfyUI) and diffusers' names. Open a pull
request on the adapter's own repo (like the safetensors conversion bot: re-runs update our open PR), or push the
converted adapter to your account."""
MODES = {"Open a pull request on the adapter's repo": "pr", "Push to my account": "push"}


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
        raise UsageError(SIGN_IN)
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
    family = f" (diffusion family `{info['family']}`: {', '.join(info['components'])})" if info["family"] else ""
    return (
        f"✅ `{info['pinned']}`: {info['architecture']}{family}, {info['parameters'] / 1e6:,.1f} M parameters, "
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
                    f"✅ `{a['pinned']}` × {weight_text(spec.weight)}: {a['format']}, rank {a['rank']}, "
                    f"alpha {a['alpha']}"
                    f"{', DoRA' if a['dora'] else ''}, {a['tensors']} tensors"
                    + (f", trained on `{html.escape(a['trained_on'])}`" if a["trained_on"] else "")
                )
            except ConverterError as e:
                lines.append(f"❌ {html.escape(str(e))}")
    return "\n\n".join(lines)


def suggest_repo(base: str, adapters: str, profile: gr.OAuthProfile | None):
    user = profile.username if profile is not None else "you"
    return gr.update(placeholder=default_repo(user, base or "", adapters or ""))


def _request(
    base, adapters, repo, dtype, qlora, verify, prompts, private, create_pr, gguf, on_jobs, profile
) -> JobRequest:
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
        gguf=gguf or "none",
        on_jobs=bool(on_jobs),
    )


def check_job(
    base, adapters, repo, dtype, qlora, verify, prompts, private, create_pr, gguf, on_jobs,
    profile: gr.OAuthProfile | None, oauth_token: gr.OAuthToken | None,
) -> str:  # fmt: skip
    """The plan before the work: formats, coverage, bytes to download and write, warnings, and whether it fits
    this Space (where not: the Hugging Face Jobs flavor that does, its time and cost)."""
    token = None
    try:
        token = _token(oauth_token)
        request = _request(base, adapters, repo, dtype, qlora, verify, prompts, private, create_pr, gguf, on_jobs,
                           profile)  # fmt: skip
        with temp_folder("check") as tmp, job_sources(Path(tmp) / "cache"):
            try:
                report = check(request.recipe(), token, Path(tmp) / "standin", space_machine(WORKROOT),
                               request.verify_settings())  # fmt: skip
                plan = public_paths(report.markdown(), tmp)
            except ConverterError as e:  # the page names Hub repos, never where the server keeps them
                e.args = (public_paths(str(e), tmp),)
                raise
    except Exception as e:  # noqa: BLE001 - every failure becomes a readable message
        raise _fail(e, token) from None
    return f"### Plan → `{html.escape(request.repo_id)}`\n\n" + plan


def run(
    base, adapters, repo, dtype, qlora, verify, prompts, private, create_pr, gguf, on_jobs,
    profile: gr.OAuthProfile | None, oauth_token: gr.OAuthToken | None, progress=gr.Progress(),  # noqa: B008 - gradio's way
):  # fmt: skip
    """The job, as a generator: the live log streams while it runs; the result replaces it at the end."""
    token = None
    try:
        token = _token(oauth_token)
        request = _request(base, adapters, repo, dtype, qlora, verify, prompts, private, create_pr, gguf, on_jobs,
                           profile)  # fmt: skip
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
                stage=lambda name: state.update(stage=name),
                log=lines.append,
            )
        except BaseException as e:  # noqa: BLE001 - handed to the page below
            state["error"] = e

    worker = threading.Thread(target=work, name="converter-job", daemon=True)
    worker.start()
    skip = (gr.skip(),) * 5
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
    if result.gguf_url:
        summary += f"\n\nGGUF ({html.escape(request.gguf)}, proven before it was pushed): {result.gguf_url}"
    report = result.report
    verification = (markdown(VerificationReport.from_dict(report)) if report else
                    "**Not verified** (verification was switched off).")  # fmt: skip
    generations = [[g["prompt"], g["base"], g["reference"], g["merged"]] for g in (report or {}).get("generations", [])]
    images = gr.update(value=result.images or None, visible=bool(result.images))  # diffusion: the pictures
    table = gr.update(value=generations, visible=bool(generations))  # an LLM: the texts
    yield ("\n".join(lines), summary, verification, table, images, result.card)


def suggest_convert_repo(adapter: str, to: str, profile: gr.OAuthProfile | None):
    user = profile.username if profile is not None else "you"
    return gr.update(placeholder=default_convert_repo(user, adapter or "org/adapter", to or "diffusers"))


def run_conversion(
    adapter, to, base, mode, repo, profile: gr.OAuthProfile | None, oauth_token: gr.OAuthToken | None
) -> tuple[str, str]:
    """A conversion: the adapter converted in a temp folder, then the PR on its repo, or a repo of one's own."""
    token = None
    lines: list[str] = []
    try:
        token = _token(oauth_token)
        request = ConvertRequest(str(adapter or ""), to, str(base or ""), MODES.get(mode, mode), str(repo or ""))
        request.check()
        result = run_convert(request, token, workroot=WORKROOT, log=lines.append)
    except Exception as e:  # noqa: BLE001 - every failure becomes a readable message
        raise _fail(e, token) from None
    if result.url is None:
        summary = f"### ✅ Nothing to do: `{html.escape(result.repo_id)}` already has a {to} version"
    elif request.mode == "pr":
        summary = f"### ✅ Pull request opened on `{html.escape(result.repo_id)}`: [{result.url}]({result.url})"
    else:
        summary = f"### ✅ Pushed: [{html.escape(result.repo_id)}]({result.url})"
    details = [f"{result.modules} LoRA modules converted to {to}" + (f": {', '.join(result.files)}" if result.files
               else ""), *result.proofs]  # fmt: skip
    return "\n".join(result.log), summary + "\n\n" + "\n".join(f"- {html.escape(d)}" for d in details)


def build() -> gr.Blocks:
    with gr.Blocks(title="LoRA merge (converter)") as demo:
        gr.Markdown(INTRO)
        with gr.Row():
            gr.LoginButton(min_width=250)
            user = gr.Markdown(elem_id="user")
        with gr.Tabs():
            with gr.Tab("Merge", elem_id="merge-tab"):
                with gr.Row():
                    with gr.Column():
                        base = gr.Textbox(
                            label="Base model (Hub id): a transformers model, a diffusers pipeline, or a single file",
                            placeholder="org/name, org/name@revision or org/name/file.safetensors",
                            elem_id="base",
                        )
                        base_status = gr.Markdown(elem_id="base-status")
                        adapters = gr.Textbox(
                            label="Adapters: one per line, `org/name[@revision][/file.safetensors] [weight]`; a "
                            "diffusion LoRA may take a weight per component: `unet=0.8,text_encoder=0.5`",
                            placeholder="someone/my-lora\nsomeone/other-lora 0.5\nsomeone/sd-loras/style.safetensors "
                            "unet=0.8,text_encoder=0.5",
                            lines=3,
                            elem_id="adapters",
                        )
                        adapter_status = gr.Markdown(elem_id="adapter-status")
                        repo = gr.Textbox(label="Target repo (empty: the suggestion shown)", elem_id="repo")
                        with gr.Row():
                            private = gr.Checkbox(label="Private repo", value=False)
                            create_pr = gr.Checkbox(
                                label="Open as a pull request (repo already has a model)", value=False
                            )
                        with gr.Accordion("Options", open=False):
                            dtype = gr.Dropdown(
                                list(DTYPES), value="keep", label="Output dtype (keep: each tensor's own)"
                            )
                            qlora = gr.Dropdown(
                                ["original", "dequantized"],
                                value="original",
                                label="QLoRA adapters: merge into the original weights, or their 4-bit dequantized "
                                "view",
                            )
                            verify = gr.Checkbox(
                                label="Verify against base + adapters, unmerged (PEFT or diffusers; where diffusers "
                                "cannot apply the file, the published formula in float64)",
                                value=True,
                            )
                            prompts = gr.Textbox(
                                label="Verification prompts, one per line (empty: built-in set)", lines=3
                            )
                            gguf = gr.Dropdown(
                                list(GGUF_CHOICES),
                                value="none",
                                label="Also a GGUF for llama.cpp, Ollama, LM Studio (proven before anything is "
                                "pushed; into REPO-GGUF)",
                                elem_id="gguf",
                            )
                        on_jobs = gr.Checkbox(
                            label="Run on Hugging Face Jobs with my account (for a model too big for this Space; "
                            "needs PRO or an organization with credits; Check shows the machine, time and cost)",
                            value=False,
                            elem_id="on-jobs",
                        )
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
                    images = gr.Gallery(
                        label="Per prompt: base, reference (base + LoRA, unmerged or by the published formula), merged",
                        columns=3,
                        visible=False,
                        elem_id="images",
                    )
                with gr.Accordion("Model card preview", open=False):
                    card = gr.Markdown(elem_id="card")
            with gr.Tab("Convert a LoRA", elem_id="convert-tab"), gr.Row():
                with gr.Column():
                    gr.Markdown(CONVERT_INTRO)
                    c_adapter = gr.Textbox(
                        label="Adapter (Hub id)", placeholder="org/name/file.safetensors", elem_id="convert-adapter"
                    )
                    c_to = gr.Dropdown(list(TARGETS), value="diffusers", label="Target format", elem_id="convert-to")
                    c_base = gr.Textbox(
                        label="Base (optional): module names are looked up in it",
                        placeholder="org/name or org/name/file.safetensors",
                        elem_id="convert-base",
                    )
                    c_mode = gr.Radio(list(MODES), value=next(iter(MODES)), label="Publish", elem_id="convert-mode")
                    c_repo = gr.Textbox(
                        label="Repo for 'Push to my account' (empty: the suggestion)", elem_id="convert-repo"
                    )
                    c_run = gr.Button("Convert", variant="primary", elem_id="convert-run")
                with gr.Column():
                    c_result = gr.Markdown(elem_id="convert-result")
                    c_log = gr.Textbox(label="Log", lines=10, max_lines=20, elem_id="convert-log")

        form = [base, adapters, repo, dtype, qlora, verify, prompts, private, create_pr, gguf, on_jobs]
        demo.load(show_user, outputs=user, queue=False)
        base.change(base_info, inputs=base, outputs=base_status, queue=False, api_visibility="private")
        adapters.change(adapters_info, inputs=adapters, outputs=adapter_status, queue=False, api_visibility="private")
        for box in (base, adapters):
            box.change(suggest_repo, inputs=[base, adapters], outputs=repo, queue=False, api_visibility="private")
        check_btn.click(check_job, inputs=form, outputs=plan, api_name="check", concurrency_id="check")
        run_btn.click(
            run,
            inputs=form,
            outputs=[logbox, result, verification, generations, images, card],
            api_name="run",
            concurrency_limit=CONCURRENCY,
            concurrency_id="job",
        )
        for box in (c_adapter, c_to):
            box.change(
                suggest_convert_repo, inputs=[c_adapter, c_to], outputs=c_repo, queue=False, api_visibility="private"
            )
        c_run.click(
            run_conversion,
            inputs=[c_adapter, c_to, c_base, c_mode, c_repo],
            outputs=[c_log, c_result],
            api_name="convert",
            concurrency_id="job",
        )
    return demo


def main(blocks: gr.Blocks | None = None) -> None:
    """Serve the page (`blocks`: built already, as `make run` builds it with the libraries' lines held back)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("httpx", "httpx2"):  # one INFO line per HTTP request
        logging.getLogger(noisy).setLevel(logging.WARNING)
    startup_cleanup(WORKROOT, log.info)  # job folders and HF caches of a previous (killed) process
    (blocks or build()).queue(max_size=QUEUE_SIZE, default_concurrency_limit=CONCURRENCY).launch()


if __name__ == "__main__":
    main()
