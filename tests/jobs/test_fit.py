"""The estimate (converter.jobs.fit) on made-up shapes and machines, the Jobs flavors and who may pay
(converter.hub.hf_jobs), and the job's command and labels (converter.jobs.remote): typed results, no network."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from converter.engine.recipe import AdapterSpec, Recipe
from converter.errors import DoesNotFit, JobsUnavailable, UsageError
from converter.hub import hf_jobs
from converter.hub.hf_jobs import FALLBACK_FLAVORS, Hardware, check_can_pay
from converter.io.units import human_bytes
from converter.jobs import fit, remote
from converter.jobs.shape import JobShape
from converter.jobs.streaming import SHARDS_ON_DISK, WINDOW_SHARDS

GB = 10**9
SHA = "a" * 40


def shape(**changes) -> JobShape:
    """A 16 GB bf16 model in 4 GB files, a 100 MB adapter, verified, streamable."""
    base = JobShape(base="org/big", hub=True, weights=16 * GB, largest_file=4 * GB, largest_tensor=GB // 2,
                    side=10**7, adapters=10**8,
                    output=16 * GB, parameters=8 * GB, behaviour=6 * GB, cannot_stream=None, verify=True)  # fmt: skip
    return replace(base, **changes)


def machine(**changes) -> fit.Machine:
    return replace(fit.Machine("here", disk=500 * GB, memory=32 * GB, cores=2, link=50e6, where="/tmp"), **changes)


def test_a_streamed_push_holds_a_few_files_of_each_side():
    s = shape()
    e = fit.estimate(s, machine())
    assert e.streamed and e.fits and e.why == "both proofs run as the models stream"
    held = WINDOW_SHARDS * s.shard + s.largest_tensor + s.side + SHARDS_ON_DISK * s.shard + s.adapters
    assert s.shard == 512 * 2**20 and e.disk == held < s.weights + s.output  # the shard: at most 512 MiB
    assert e.memory == fit.PROCESS_MEMORY + s.behaviour
    assert e.download == s.weights + s.side + s.adapters and e.upload == s.output
    cpu = fit.VERIFIED_CPU_FIXED + fit.VERIFIED_CPU_PER_GB * 16
    assert e.cpu_seconds == pytest.approx(cpu)
    transfer = max(e.download, e.upload) / 50e6
    assert e.seconds == pytest.approx(max(transfer, cpu / fit.PARALLEL) + s.shard / 50e6)
    unverified = fit.estimate(replace(s, verify=False), machine())
    assert unverified.disk == held  # the same window: the merge's own reads are what it holds then


def test_what_cannot_stream_is_read_whole():
    full = fit.estimate(shape(cannot_stream="the full check generates continuations"), machine())
    assert not full.streamed and full.why == "the full check generates continuations"
    assert full.disk == 16 * GB + 10**7 + 16 * GB + 10**8  # the base download and the output, whole
    short = fit.estimate(shape(), machine(memory=4 * GB))  # two forwards of 3 GB do not fit in 4 GB
    assert not short.streamed and "memory" in short.why and short.memory == fit.PROCESS_MEMORY  # (offloads)
    budget = fit.estimate(shape(memory_budget=64 * GB), machine(memory=4 * GB))  # --verify-memory
    assert budget.streamed
    local = fit.estimate(shape(hub=False), machine())  # read in place: no base bytes on disk, none downloaded
    assert local.disk == SHARDS_ON_DISK * 512 * 2**20 + 10**8 and local.download == 10**8
    merge = fit.estimate(shape(), machine(), "merge")
    assert not merge.streamed and merge.disk == 32 * GB + 10**7 + 10**8 and merge.upload == 0


def test_a_job_too_big_here_names_the_cheapest_flavor_that_fits():
    hardware = Hardware(FALLBACK_FLAVORS, "a built-in table")
    with pytest.raises(DoesNotFit) as refused:  # less than its largest tensor: no shard size makes it fit
        fit.require_fit(shape(), machine(disk=GB // 4), hardware)
    e = refused.value
    assert (e.flavor, e.free, e.where) == ("cpu-basic", GB // 4, "/tmp") and e.disk > e.free
    assert e.seconds > fit.JOB_START_SECONDS and 0 < e.usd < 0.01
    assert str(e).startswith("org/big: does not fit here: it needs ") and str(e).endswith("--on-jobs cpu-basic")
    # 60 GB of memory per forward: only cpu-xl holds the streamed comparison; the others would read the output
    # whole (the base is mounted, read in place), which their 20 GB of disk cannot hold
    big = shape(behaviour=120 * GB, output=40 * GB)
    estimates = fit.on_jobs(big, hardware)
    assert [(e.machine.name, e.streamed, e.fits) for e in estimates] == [
        ("cpu-basic", False, False), ("cpu-upgrade", False, False), ("cpu-xl", True, True),
    ]  # fmt: skip
    assert fit.best_flavor(estimates).machine.name == "cpu-xl"
    assert estimates[2].timeout == int(fit.TIMEOUT_FACTOR * estimates[2].seconds) + fit.TIMEOUT_MARGIN
    with pytest.raises(DoesNotFit, match="no Hugging Face Jobs CPU flavor fits it either") as none:
        fit.require_fit(shape(cannot_stream="a full check", output=2 * 10**12), machine(disk=GB), hardware)
    assert none.value.flavor is None


def test_the_flavors_come_from_the_hardware_list_with_the_table_filling_gaps():
    def info(name, cpu, ram, storage, per_minute, gpu=None):
        return SimpleNamespace(name=name, cpu=cpu, ram=ram, ephemeral_storage=storage, accelerator=gpu,
                               unit_cost_usd=per_minute, unit_label="minute")  # fmt: skip

    flavors = [
        hf_jobs._flavor(info("cpu-upgrade", "8 vCPU", "32 GB", "N/A", 0.0005), FALLBACK_FLAVORS[1]),
        hf_jobs._flavor(info("cpu-xl", "16 vCPU", "124 GB", "1 TB", 1 / 60), FALLBACK_FLAVORS[2]),
        hf_jobs._flavor(info("l4x1", "8 vCPU", "30 GB", "N/A", 0.8 / 60, gpu=object()), None),
    ]
    assert flavors[0] == hf_jobs.Flavor("cpu-upgrade", 8, 32 * GB, None, pytest.approx(0.03))
    assert flavors[1].disk == 10**12 and flavors[1].usd_per_hour == pytest.approx(1.0)
    assert [f.name for f in Hardware(tuple(flavors), "x").cpu] == ["cpu-upgrade", "cpu-xl"]  # no GPU, cheapest first
    assert fit.on_flavor(flavors[0]).disk == 20 * GB  # not stated: the smallest disk the table states


def test_jobs_need_pro_or_an_organization_with_credits():
    who = {
        "name": "frank",
        "canPay": False,
        "isPro": False,
        "orgs": [{"name": "acme"}, {"name": "poor", "canPay": False}],
    }
    with pytest.raises(JobsUnavailable, match="PRO") as refused:
        check_can_pay(who, "frank")
    assert refused.value.namespace == "frank"
    check_can_pay(who, "acme")  # an organization whose credits whoami does not show: the Hub decides (402)
    check_can_pay(who | {"isPro": True}, "frank")
    for namespace in ("poor", "elsewhere"):
        with pytest.raises(JobsUnavailable):
            check_can_pay(who, namespace)


def test_the_jobs_command_says_the_recipe_and_the_labels_say_the_job():
    adapters = [AdapterSpec(f"me/a@{'b' * 40}", 0.5, lora_alpha=16.0),
                AdapterSpec(f"me/c@{'c' * 40}/x.safetensors", {"unet": 0.8}, lora_alpha=8.0)]  # fmt: skip
    recipe = Recipe(base=f"org/base@{SHA}", adapters=adapters, dtype="bfloat16")
    options = remote.PushOptions(private=True, verify={"mode": "full", "max_new_tokens": 4})
    args = remote.push_arguments("me/out", recipe, options)
    assert args[:8] == ["--json", "push", "--repo", "me/out", "--base", f"org/base@{SHA}", "--base-mounted", "/base"]
    pairs = list(zip(args, args[1:], strict=False))
    assert ("--weight", "0.5") in pairs and ("--weight", "unet=0.8") in pairs and ("--lora-alpha", "16.0") in pairs
    assert ("--dtype", "bfloat16") in pairs and ("--verify", "full") in pairs and ("--max-new-tokens", "4") in pairs
    assert "--private" in args and "--no-verify" not in args
    labels = remote.labels(recipe, "me/out", args)
    assert labels == {"converter": "push", "base": SHA, "target": "me--out", "adapter-1": "b" * 40,
                      "adapter-2": "c" * 40, "options": labels["options"]}  # fmt: skip
    other = remote.labels(recipe, "me/out", remote.push_arguments("me/out", recipe, remote.PushOptions(verify=None)))
    assert other["options"] != labels["options"] and other["base"] == labels["base"]
    with pytest.raises(UsageError, match="include / exclude"):
        remote.push_arguments("me/out", Recipe(base="o/b", adapters=[AdapterSpec("o/a", include=["q_proj"])]),
                              options)  # fmt: skip
    with pytest.raises(UsageError, match="a local path"):
        remote.pinned(Recipe(base=".", adapters=[AdapterSpec("o/a")]), None)


def test_how_converter_gets_into_the_job(monkeypatch):
    from converter import __version__

    monkeypatch.delenv("CONVERTER_JOBS_IMAGE", raising=False)
    monkeypatch.delenv("CONVERTER_JOBS_FROM", raising=False)
    runner = remote.Runner.default()
    assert runner.image == remote.DEFAULT_IMAGE and runner.command(["push"]) == [
        "uvx", "--from", f"converter=={__version__}", "converter", "push"]  # fmt: skip
    monkeypatch.setenv("CONVERTER_JOBS_IMAGE", "me/converter:1")
    monkeypatch.setenv("CONVERTER_JOBS_FROM", "-")
    assert remote.Runner.default().command(["push"]) == ["converter", "push"]
    assert remote.Runner.default(install="git+https://example.com/converter").install.startswith("git+")


def test_a_mounted_base_is_named_by_its_commit(tmp_path):
    from converter.hub.sources import mounted, parse_source, use_mounted

    with pytest.raises(UsageError, match="40-hex sha"):
        use_mounted("org/base@main", tmp_path)
    use_mounted(f"Org/Base@{SHA}", tmp_path)
    assert mounted(parse_source(f"org/base@{SHA}")) == tmp_path and mounted(parse_source("org/base")) is None


def test_without_verification_the_process_needs_little_memory():
    """A merge alone streams in a few hundred MiB (it finishes under a 512 MiB cap): only a verified job needs the
    libraries' memory, so only it is refused on a small machine."""
    small = machine(memory=512 * 2**20)
    assert fit.estimate(shape(verify=False), small).fits
    refused = fit.estimate(shape(), small)
    assert not refused.fits and refused.short.startswith(f"it needs {human_bytes(fit.PROCESS_MEMORY)} of memory")


def test_a_small_disk_takes_smaller_output_shards_unless_the_user_gave_their_size():
    s = shape()
    roomy = fit.estimate(s, machine())
    tight = machine(disk=roomy.disk // 2)
    e = fit.estimate(s, tight)
    assert e.fits and e.streamed and e.shard < roomy.shard == s.shard and e.disk <= tight.disk
    assert e.shard >= fit.SMALLEST_SHARD and fit.estimate(replace(s, max_shard_size=str(e.shard)), tight).fits
    given = fit.estimate(replace(s, max_shard_size=str(s.shard)), tight)
    assert not given.fits and given.shard == s.shard  # the size the user asked for is kept: refused
    hopeless = fit.estimate(s, machine(disk=s.largest_tensor))
    assert not hopeless.fits and hopeless.shard == s.shard
