"""The model card (README.md): what was merged, exactly, and how well it was checked. Never a token or a path.

Everything comes from the output folder's provenance record, so a card can be rebuilt at any time (after
verification, before a push) and says only what the record supports. The verification section comes written:
the hub sits below verification, whose renderer (`converter.verification.render.card_section`) writes it from
the typed report.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from converter.io.records import PROVENANCE_FILE, RECIPE_FILE, REPORT_FILE, read_provenance, read_report

TOOL_TAG = "converter"
FRONT_MATTER = re.compile(r"\A---\s*\n(.*?)\n---\s*\n", re.S)
# Metadata a merged model inherits from its base card.
INHERITED = ("license", "license_name", "license_link", "language", "pipeline_tag", "library_name")


def card_metadata(text: str | None) -> dict:
    """The YAML front matter of a card, or {} (a broken card is not our problem to fail on)."""
    if not text:
        return {}
    m = FRONT_MATTER.match(text)
    if not m:
        return {}
    try:
        data = yaml.safe_load(m.group(1))
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def public_name(record: dict) -> str:
    """How a source is named in public: `org/name@sha[/file]`, or only the folder name for local sources."""
    if record.get("repo_id"):
        return f"{record['repo_id']}@{record['revision']}" + (f"/{record['path']}" if record.get("path") else "")
    return f"local: {Path(record['source']).name}"


def _as_list(value) -> list:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def build_card(provenance: dict, verification: str | None = None, load_name: str = "path/to/this-model") -> str:
    """The card's text; `verification`: the verification section in Markdown (None: not verified)."""
    from huggingface_hub import ModelCard, ModelCardData

    base = provenance["base"]
    base_meta = base.get("card") or {}
    meta = {k: base_meta[k] for k in INHERITED if base_meta.get(k) is not None}
    if meta.get("library_name") in (None, "peft"):
        meta["library_name"] = "diffusers" if base.get("layout") else "transformers"
    if meta.get("license") != "other":
        meta.pop("license_name", None)
        meta.pop("license_link", None)
    datasets: list[str] = []
    for adapter in provenance["adapters"]:
        for name in _as_list((adapter.get("card") or {}).get("datasets")):
            if name not in datasets:
                datasets.append(name)
    tags = [t for t in _as_list(base_meta.get("tags")) if isinstance(t, str) and not t.startswith("base_model:")]
    tags = list(dict.fromkeys([*tags, "lora", "merged", TOOL_TAG]))
    data = ModelCardData(
        base_model=base.get("repo_id"),
        base_model_relation="finetune" if base.get("repo_id") else None,
        datasets=datasets or None,
        tags=tags,
        **meta,
    )
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n{_body(provenance, verification, load_name)}")
    return str(card)


def _body(prov: dict, verification: str | None, repo: str) -> str:
    base = prov["base"]
    name = base.get("repo_id") or Path(base["source"]).name
    lines = [
        f"# {name} + {len(prov['adapters'])} LoRA adapter(s), merged",
        "",
        f"The base model `{public_name(base)}` with the adapters below folded into its weights by "
        f"converter {prov['version']}. It loads like any "
        f"{'model' if not base.get('model_type') else base['model_type'] + ' model'}: no PEFT needed.",
        "",
        "## What was merged",
        "",
        "| # | adapter | weight | format | rank | alpha | DoRA | rsLoRA | tensors used |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i, a in enumerate(prov["adapters"], 1):
        s = a.get("settings") or {}
        ranks = s.get("ranks") or [s.get("r")]
        cov = a.get("coverage") or {}
        lines.append(
            f"| {i} | `{public_name(a)}` | {a['weight']} | {a['format']} | {', '.join(map(str, ranks))} | "
            f"{_alpha(s)} | {'yes' if s.get('use_dora') else 'no'} | {'yes' if s.get('use_rslora') else 'no'}"
            f" | {cov.get('used')}/{cov.get('tensors')} |"
        )
    changed = prov["tensors"]["changed"]
    lines += [
        "",
        "## Precision",
        "",
        f"{prov['precision'][0].upper()}{prov['precision'][1:]}. Output dtype: {prov['dtype']}. "
        f"{len(changed)} of {prov['tensors']['total']} tensors changed.",
    ]
    if prov.get("config_updates"):
        changes = ", ".join(f"`{k}: {json.dumps(v)}`" for k, v in prov["config_updates"].items())
        lines += ["", f"config.json changes: {changes}."]
    if prov.get("task_head"):
        lines += ["", _task_head(prov["task_head"])]
    lines += ["", "## Verification", ""]
    if verification:
        lines.append(verification)
    else:
        lines.append("**Not verified.** This merge was not compared with the base + adapters; treat it as untested.")
    lines += ["", "## How to load", "", *_load_snippet(base, repo, prov.get("task_head")), ""]
    lines += [
        "## Recipe",
        "",
        "The exact recipe (sources pinned to the commits used):",
        "",
        "```yaml",
        public_recipe(prov).rstrip(),
        "```",
        "",
    ]
    return "\n".join(lines)


def _alpha(settings: dict) -> str:
    """PEFT adapters have one lora_alpha; community files an alpha per module (listed, or none stored)."""
    if "lora_alpha" in settings or "alphas" not in settings:
        return str(settings.get("lora_alpha"))
    return ", ".join(f"{a:g}" for a in settings["alphas"]) or "none (scale 1)"


def _task_head(head: dict) -> str:
    """What a classifier made from a causal LM's checkpoint is, as written: its head from the adapter, the
    language-model head left out."""
    own = ", ".join(f"`{n}`" for n in head["head"])
    dropped = (f"the base's language-model head ({', '.join(f'`{n}`' for n in head['dropped'])}) is dropped"
               if head["dropped"] else "the base's tied language-model head goes with it")  # fmt: skip
    return (f"Written as `{head['class']}`, the class the adapter was trained as (task_type {head['task_type']}) "
            f"from the base's causal-LM checkpoint: its head {own} comes from the adapter (modules_to_save), and "
            f"{dropped}, since a classifier has none. {head['labels']} label(s), pad_token_id "
            f"{head['pad_token_id']}.")  # fmt: skip


def _load_snippet(base: dict, repo: str, head: dict | None = None) -> list[str]:
    if base.get("layout") == "diffusers":
        return [
            "```python",
            "from diffusers import DiffusionPipeline",
            f'pipe = DiffusionPipeline.from_pretrained("{repo}")',
            "```",
        ]
    if base.get("layout") == "single_file":
        where = f"{repo}/{base.get('file')}"
        if not base.get("pipeline"):
            return [
                f"`{base.get('file')}` is a single-file {base.get('family')} checkpoint, in the base's own layout: "
                "load it with the tool you use for the base (ComfyUI, musubi-tuner ...)."
            ]
        return [
            f"`{base.get('file')}` keeps the base's single-file layout (ComfyUI, A1111/Forge load it as is), or:",
            "",
            "```python",
            f"from diffusers import {base['pipeline']}",
            f'pipe = {base["pipeline"]}.from_single_file("{where}")',
            "```",
        ]
    auto = head["auto_class"] if head else "AutoModelForCausalLM"
    return [
        "```python",
        f"from transformers import {auto}, AutoTokenizer",
        f'model = {auto}.from_pretrained("{repo}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{repo}")',
        "```",
    ]


def public_recipe(prov: dict) -> str:
    recipe = {
        "base": public_name(prov["base"]),
        "adapters": [
            {
                k: v
                for k, v in {
                    "source": public_name(a),
                    "weight": a["weight"],
                    "include": a.get("include") or None,
                    "exclude": a.get("exclude") or None,
                }.items()
                if v is not None
            }
            for a in prov["adapters"]
        ],
    }
    if prov.get("dtype") and prov["dtype"] != "as base":
        recipe["dtype"] = prov["dtype"]
    return yaml.safe_dump(recipe, sort_keys=False)


def write_card(folder: Path, load_name: str | None = None, verification: str | None = None) -> Path:
    """(Re)write folder/README.md from the folder's provenance record and `verification`, the verification
    section written by `converter.verification.render.card_section` from the folder's report (None: the card
    says not verified)."""
    provenance = read_provenance(folder)
    text = build_card(provenance, verification, load_name or f"./{folder.name}")
    (folder / "README.md").write_text(text)
    return folder / "README.md"


# Measurements of one verification run: kept in the local report, left out of the published one so that the
# same merge publishes the same bytes (a re-push is then a no-op).
RUN_SPECIFIC = ("seconds", "phase_seconds", "phase_cpu_seconds", "peak_rss_mb", "offload_memory_bytes")


def public_records(folder: Path) -> dict[str, bytes]:
    """The recipe, provenance and verification report as published: local sources named by folder name only,
    never by path, and no run-specific measurements."""
    prov = read_provenance(folder)
    for record in (prov["base"], *prov["adapters"]):
        if not record.get("repo_id"):
            record["source"] = public_name(record)
    for adapter in prov["adapters"]:  # the base it was trained on, as its adapter_config.json names it
        trained_on = adapter.get("base_model") or ""
        if trained_on.startswith(("/", ".", "~")) or "\\" in trained_on:
            adapter["base_model"] = f"local: {Path(trained_on).name}"
    records = {
        PROVENANCE_FILE: (json.dumps(prov, indent=2) + "\n").encode(),
        RECIPE_FILE: public_recipe(prov).encode(),
    }
    if (folder / REPORT_FILE).is_file():
        report = {k: v for k, v in read_report(folder).items() if k not in RUN_SPECIFIC}
        records[REPORT_FILE] = (json.dumps(report, indent=2) + "\n").encode()
    return records
