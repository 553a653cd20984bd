"""The fake Hub (converter.testing.hub) against the REAL huggingface_hub 2.4 client.

Client code runs in subprocesses: huggingface_hub reads HF_ENDPOINT / HF_HUB_DISABLE_XET / HF_HOME at import time,
and this process has already imported it in offline mode (conftest). Each test uses its own repos on one shared
server; the tests that count downloads use their own HF_HOME.
"""

from __future__ import annotations

import hashlib
import json
import logging
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from converter.testing.hub import HubServer, client_env, git_blob_sha1, hub_env, run_client

ALICE, BOB, CAROL = "hf_alice_secret_token", "hf_bob_secret_token", "hf_carol_secret_token"

PRELUDE = """
import json, time
from huggingface_hub import HfApi, CommitOperationAdd, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError, HfHubHTTPError, RemoteEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError,
)
api = HfApi()

def result(obj):
    print("RESULT " + json.dumps(obj, default=str))

def error(fn):
    try:
        fn()
    except Exception as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        return [type(e).__name__, status]
    return None
"""


def client(hub: HubServer, code: str, token: str | None = None, home: Path | None = None) -> Any:
    """Run ``code`` (after PRELUDE) in a fresh interpreter; returns what it passed to ``result``."""
    proc = run_client(hub, PRELUDE + textwrap.dedent(code), token=token, home=home)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, hub.redact(proc.stdout + proc.stderr)
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> HubServer:
    with HubServer(tmp_path_factory.mktemp("hub")) as server:
        server.add_user("alice", ALICE, orgs=["acme"])
        server.add_user("bob", BOB, orgs=["acme"])
        server.add_user("carol", CAROL)
        server.add_token("carol", "hf_carol_readonly", role="read")
        yield server


@pytest.fixture(autouse=True)
def _clean(hub: HubServer) -> None:
    hub.clear_faults()
    hub.reset_log()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("model")
    torch.manual_seed(0)
    save_file({"w": torch.randn(32, 16), "b": torch.randn(16)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    (folder / "README.md").write_text("---\nlicense: apache-2.0\nbase_model: org/base\ntags: [merge]\n---\n# Merged\n")
    (folder / "sub").mkdir()
    (folder / "sub" / "notes.txt").write_text("hello\n")
    return folder


def test_client_env_isolates_from_developer_settings(hub: HubServer) -> None:
    env = client_env(hub, base={"PATH": "/bin", "HF_TOKEN": "real", "HF_HUB_CACHE": "/home/x", "HF_HUB_OFFLINE": "1"})
    assert env["PATH"] == "/bin" and "HF_TOKEN" not in env and "HF_HUB_CACHE" not in env
    assert env["HF_ENDPOINT"] == hub.url and env["HF_HUB_DISABLE_XET"] == "1" and env["HF_HUB_OFFLINE"] == "0"
    assert hub_env(hub, token=ALICE)["HF_TOKEN"] == ALICE


def test_whoami_create_repo_and_permissions(hub: HubServer) -> None:
    out = client(
        hub,
        """
        me = api.whoami()
        url = api.create_repo("alice/created")
        again = error(lambda: api.create_repo("alice/created"))
        ok = api.create_repo("alice/created", exist_ok=True).repo_id
        api.create_repo("alice/secret", private=True)
        org = api.create_repo("acme/shared").repo_id
        foreign = error(lambda: api.create_repo("carol/nope"))
        space = api.create_repo("alice/app", repo_type="space", space_sdk="gradio")
        bad = error(lambda: api.whoami(token="hf_wrong"))
        readonly = error(lambda: api.create_repo("carol/ro", token="hf_carol_readonly"))
        api.create_repo("alice/doomed")
        api.delete_repo("alice/doomed")
        deleted = [api.repo_exists("alice/doomed"), error(lambda: api.delete_repo("alice/doomed"))]
        api.delete_repo("alice/doomed", missing_ok=True)
        result(dict(name=me["name"], orgs=[o["name"] for o in me["orgs"]], role=me["auth"]["accessToken"]["role"],
                    repo_id=url.repo_id, again=again, ok=ok, org=org, foreign=foreign, bad=bad, readonly=readonly,
                    deleted=deleted,
                    space=[space.repo_type, space.repo_id], sdk=api.space_info("alice/app").sdk))
        """,
        token=ALICE,
    )
    assert out["name"] == "alice" and out["orgs"] == ["acme"] and out["role"] == "write"
    assert out["repo_id"] == "alice/created" and out["ok"] == "alice/created" and out["org"] == "acme/shared"
    assert out["again"] == ["HfHubHTTPError", 409]
    assert out["foreign"] == ["HfHubHTTPError", 403]
    assert out["bad"] == ["HfHubHTTPError", 401]
    assert out["readonly"] == ["HfHubHTTPError", 403]
    assert out["deleted"] == [False, ["RepositoryNotFoundError", 404]] and not hub.exists("alice/doomed")
    assert out["space"] == ["space", "alice/app"] and out["sdk"] == "gradio"
    assert hub.repo("alice/secret").private and not hub.repo("alice/created").private
    assert "sdk: gradio" in hub.read_file("alice/app", "README.md", repo_type="space").decode()
    assert [c.title for c in hub.history("alice/created")] == ["initial commit"]


def test_upload_folder_lfs_and_noop_reupload(hub: HubServer, model_dir: Path) -> None:
    hub.create_repo("alice/up")
    code = f"""
        first = api.upload_folder(repo_id="alice/up", folder_path={str(model_dir)!r}, commit_message="upload")
        second = api.upload_folder(repo_id="alice/up", folder_path={str(model_dir)!r})
        result([first.oid, second.oid, [[c.commit_id, c.title] for c in api.list_repo_commits("alice/up")]])
    """
    first, second, commits = client(hub, code, token=ALICE)
    assert first == second == hub.head("alice/up")  # the re-upload made no commit
    assert commits == [[c.sha, c.title] for c in hub.history("alice/up")]
    assert [c.title for c in hub.history("alice/up")] == ["upload", "initial commit"]
    files = hub.files("alice/up")
    weights = (model_dir / "model.safetensors").read_bytes()
    assert files["model.safetensors"].lfs and files["model.safetensors"].sha256 == hashlib.sha256(weights).hexdigest()
    assert not files["config.json"].lfs and files["config.json"].oid == git_blob_sha1(
        (model_dir / "config.json").read_bytes()
    )
    assert hub.read_file("alice/up", "sub/notes.txt") == b"hello\n"
    commits = [r for r in hub.requests if r[1].endswith("/commit/main")]
    puts = [r for r in hub.requests if r[0] == "PUT"]
    assert len(commits) == 1 and len(puts) == 1  # second run: preupload said "unchanged", nothing sent


def test_one_lfs_object_under_two_paths_of_a_commit(hub: HubServer, tmp_path: Path) -> None:
    """Two identical binary files (a correct merge's reference and merged images) in one commit: the client uploads
    the object twice, and the Hub, like S3, takes it."""
    hub.create_repo("alice/twins")
    blob = bytes(range(256)) * 64
    for name in ("a.png", "b.png"):
        (tmp_path / name).write_bytes(blob)
    code = f"""
        api.upload_folder(repo_id="alice/twins", folder_path={str(tmp_path)!r})
        result(sorted(api.list_repo_files("alice/twins")))
    """
    assert {"a.png", "b.png"} <= set(client(hub, code, token=ALICE))
    files = hub.files("alice/twins")
    assert files["a.png"].lfs and files["a.png"].sha256 == files["b.png"].sha256 == hashlib.sha256(blob).hexdigest()
    assert hub.read_file("alice/twins", "b.png") == blob


def test_downloads_by_branch_commit_and_file_then_cache(hub: HubServer, model_dir: Path, tmp_path: Path) -> None:
    old = hub.seed_folder("alice/dl", model_dir)
    new = hub.commit_files("alice/dl", {"config.json": b'{"model_type": "llama", "v": 2}'}, "bump config")
    code = f"""
        main = snapshot_download("alice/dl")
        at_old = snapshot_download("alice/dl", revision={old!r})
        one = hf_hub_download("alice/dl", "sub/notes.txt")
        result(dict(main=main, old=at_old, one=one))
    """
    out = client(hub, code, home=tmp_path)
    assert Path(out["main"]).name == new and Path(out["old"]).name == old
    assert json.loads((Path(out["main"]) / "config.json").read_text())["v"] == 2
    assert (Path(out["old"]) / "config.json").read_bytes() == (model_dir / "config.json").read_bytes()
    assert (Path(out["main"]) / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()
    assert Path(out["one"]).read_text() == "hello\n"
    assert all(s.status == 200 for s in hub.seen)

    hub.reset_log()
    again = client(hub, 'result(snapshot_download("alice/dl"))', home=tmp_path)
    assert again == out["main"]
    assert not [r for r in hub.requests if r[0] == "GET" and "/resolve/" in r[1]], hub.requests  # nothing downloaded


def test_model_info_and_tree(hub: HubServer, model_dir: Path) -> None:
    sha = hub.seed_folder("alice/info", model_dir)
    hub.tree_page_size = 2  # forces the client through Link pagination
    try:
        out = client(
            hub,
            """
            info = api.model_info("alice/info", files_metadata=True)
            sib = {s.rfilename: [s.size, s.blob_id, s.lfs and s.lfs.sha256] for s in info.siblings}
            tree = [[f.path, type(f).__name__] for f in api.list_repo_tree("alice/info", recursive=True)]
            top = [[f.path, type(f).__name__] for f in api.list_repo_tree("alice/info")]
            sub = [f.path for f in api.list_repo_tree("alice/info", path_in_repo="sub")]
            result(dict(sha=info.sha, private=info.private, gated=info.gated, sib=sib, tree=tree, top=top, sub=sub,
                        license=info.card_data.license, total=info.safetensors.total, tags=info.tags,
                        arch=info.config["architectures"], exists=api.file_exists("alice/info", "sub/notes.txt")))
            """,
        )
    finally:
        hub.tree_page_size = 1000
    weights = (model_dir / "model.safetensors").read_bytes()
    assert out["sha"] == sha and out["private"] is False and out["gated"] is False
    assert out["sib"]["model.safetensors"][0] == len(weights)
    assert out["sib"]["model.safetensors"][2] == hashlib.sha256(weights).hexdigest()
    assert out["sib"]["config.json"][1] == git_blob_sha1((model_dir / "config.json").read_bytes())
    assert out["license"] == "apache-2.0" and out["total"] == 32 * 16 + 16 and out["arch"] == ["LlamaForCausalLM"]
    assert {"merge", "safetensors", "base_model:org/base"} <= set(out["tags"])
    assert ["sub", "RepoFolder"] in out["tree"] and ["sub/notes.txt", "RepoFile"] in out["tree"]
    assert ["sub", "RepoFolder"] in out["top"] and ["sub/notes.txt", "RepoFile"] not in out["top"]
    assert out["sub"] == ["sub/notes.txt"] and out["exists"] is True
    assert sum("/tree/" in r[1] for r in hub.requests) >= 3  # pages followed


@pytest.mark.parametrize(
    "blob", [b"\xff" * 64, (8).to_bytes(8, "little") + b"[1,2,3]", (4).to_bytes(8, "little") + b'{"w"'], ids=str
)
def test_model_info_survives_files_that_are_not_safetensors(hub: HubServer, blob: bytes) -> None:
    repo = f"alice/odd-{hashlib.sha256(blob).hexdigest()[:8]}"
    hub.create_repo(repo)
    hub.commit_files(repo, {"model.safetensors": blob, "config.json": b"{}"})
    out = client(hub, f"info = api.model_info({repo!r}); result(info.safetensors is None)")
    assert out is True


def test_private_repo_visibility(hub: HubServer) -> None:
    hub.create_repo("alice/private", private=True)
    hub.commit_files("alice/private", {"config.json": b"{}"})
    code = """
        result([
            error(lambda: api.model_info("alice/private")),
            error(lambda: hf_hub_download("alice/private", "config.json")),
            api.repo_exists("alice/private"),
        ])
    """
    anon_info, anon_dl, anon_exists = client(hub, code)
    assert anon_info == ["RepositoryNotFoundError", 401] and anon_dl[0] == "RepositoryNotFoundError"
    assert anon_exists is False
    stranger = client(hub, code, token=CAROL)
    assert stranger[0] == ["RepositoryNotFoundError", 404] and stranger[2] is False
    assert client(hub, code, token=ALICE) == [None, None, True]


def test_gated_repo(hub: HubServer) -> None:
    hub.create_repo("alice/gated", gated=True)
    hub.commit_files("alice/gated", {"config.json": b"{}"})
    code = """
        result([api.model_info("alice/gated").gated, error(lambda: hf_hub_download("alice/gated", "config.json"))])
    """
    assert client(hub, code) == ["auto", ["GatedRepoError", 401]]
    assert client(hub, code, token=CAROL) == ["auto", ["GatedRepoError", 403]]
    hub.grant_access("alice/gated", "carol")
    assert client(hub, code, token=CAROL) == ["auto", None]


def test_revision_and_entry_not_found(hub: HubServer, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    sha = hub.seed_folder("alice/nf", src)
    out = client(
        hub,
        """
        result([
            error(lambda: hf_hub_download("alice/nf", "config.json", revision="nope")),
            error(lambda: api.model_info("alice/nf", revision="nope")),
            error(lambda: hf_hub_download("alice/nf", "missing.txt")),
            error(lambda: api.model_info("nobody/nothing")),
        ])
        """,
        home=tmp_path / "home",
    )
    assert out == [
        ["RevisionNotFoundError", 404],
        ["RevisionNotFoundError", 404],
        ["RemoteEntryNotFoundError", 404],
        ["RepositoryNotFoundError", 401],
    ]
    # the client remembers the 404 for this commit, as with the real Hub
    assert (tmp_path / "home/hub/models--alice--nf/.no_exist" / sha / "missing.txt").exists()


def test_pull_request_by_a_non_owner_and_discussions(hub: HubServer) -> None:
    hub.create_repo("alice/pr")
    main = hub.commit_files("alice/pr", {"model.safetensors": b"\0weights"})
    out = client(
        hub,
        """
        info = api.create_commit("alice/pr", operations=[CommitOperationAdd("model.safetensors", b"\\0better")],
                                 commit_message="Adding better weights", create_pr=True)
        discussions = [[d.num, d.title, d.status, d.is_pull_request, d.author]
                       for d in api.get_repo_discussions("alice/pr")]
        details = api.get_discussion_details("alice/pr", info.pr_num)
        content = open(hf_hub_download("alice/pr", "model.safetensors", revision=info.pr_revision), "rb").read()
        refs = api.list_repo_refs("alice/pr", include_pull_requests=True)
        direct = error(lambda: api.upload_file(path_or_fileobj=b"x", path_in_repo="x.txt", repo_id="alice/pr"))
        question = api.create_discussion("alice/pr", "Which base model?", description="Asking.")
        discussions.insert(0, [question.num, question.title, question.status, question.is_pull_request,
                               question.events[0].content])
        result(dict(pr_url=info.pr_url, num=info.pr_num, rev=info.pr_revision, oid=info.oid, discussions=discussions,
                    target=details.target_branch, events=[e.type for e in details.events], content=content.hex(),
                    prs=[[r.ref, r.target_commit] for r in refs.pull_requests], direct=direct))
        """,
        token=CAROL,
    )
    assert out["pr_url"] == f"{hub.url}/alice/pr/discussions/1" and out["num"] == 1 and out["rev"] == "refs/pr/1"
    assert out["discussions"] == [
        [2, "Which base model?", "open", False, "Asking."],
        [1, "Adding better weights", "open", True, "carol"],
    ]
    assert out["target"] == "refs/heads/main" and "commit" in out["events"]
    assert bytes.fromhex(out["content"]) == b"\0better" and out["prs"] == [["refs/pr/1", out["oid"]]]
    assert out["direct"] == ["HfHubHTTPError", 403]  # carol may propose, not push
    assert hub.head("alice/pr") == main and hub.history("alice/pr", "refs/pr/1")[1].sha == main


def test_parent_commit_mismatch_is_rejected(hub: HubServer) -> None:
    hub.create_repo("alice/race")
    stale = hub.head("alice/race")
    hub.commit_files("alice/race", {"a.txt": b"a"})
    code = f"""
        op = CommitOperationAdd("b.txt", b"b")
        result(error(lambda: api.create_commit("alice/race", operations=[op], commit_message="m",
                                               parent_commit={stale!r})))
    """
    assert client(hub, code, token=ALICE) == ["HfHubHTTPError", 412]


def test_503_on_head_is_retried(hub: HubServer, tmp_path: Path) -> None:
    hub.create_repo("alice/flaky")
    hub.commit_files("alice/flaky", {"config.json": b'{"a": 1}'})
    fault = hub.inject("HEAD", r"/resolve/main/config\.json$", status=503)
    path = client(hub, 'result(hf_hub_download("alice/flaky", "config.json"))', home=tmp_path)
    assert Path(path).read_bytes() == b'{"a": 1}' and fault.hits == 1
    assert [s.status for s in hub.seen if s.method == "HEAD"] == [503, 200]


def test_503_on_get_is_not_retried_by_the_client(hub: HubServer, tmp_path: Path) -> None:
    # huggingface_hub 2.4 retries the download GET only on 408/429 (http_get: retry_on_status_codes=(408, 429)).
    hub.create_repo("alice/flaky-get")
    hub.commit_files("alice/flaky-get", {"config.json": b'{"a": 1}'})
    hub.inject("GET", r"/resolve/", status=503)
    code = """
        first = error(lambda: hf_hub_download("alice/flaky-get", "config.json"))
        result([first, open(hf_hub_download("alice/flaky-get", "config.json")).read()])
    """
    assert client(hub, code, home=tmp_path) == [["HfHubHTTPError", 503], '{"a": 1}']


@pytest.mark.parametrize("mib", [0, 24])
def test_dropped_connection_is_retried_and_resumed(hub: HubServer, tmp_path: Path, mib: int) -> None:
    # http_get reads 10 MiB chunks (DOWNLOAD_CHUNK_SIZE) and resumes from the last whole chunk it wrote: a drop
    # before 10 MiB restarts the GET from byte 0 without Range; later drops resume with Range (answered 206).
    blob = bytes(range(256)) * (mib * 4096 or 64)
    repo = f"alice/drop-{mib}"
    hub.create_repo(repo)
    hub.commit_files(repo, {"model.safetensors": blob})
    fault = hub.inject("GET", r"/resolve/.*model\.safetensors$", drop_connection=True)
    path = client(hub, f"result(hf_hub_download({repo!r}, 'model.safetensors'))", home=tmp_path)
    assert Path(path).read_bytes() == blob and fault.hits == 1
    gets = [(s.status, s.range) for s in hub.seen if s.method == "GET"]
    assert gets == [(200, None), (206, "bytes=10485760-") if mib else (200, None)]


def test_dropped_connection_on_metadata_calls_surfaces_raw(hub: HubServer, tmp_path: Path) -> None:
    # Unlike the body GET, neither the HEAD /resolve (first try has no retry, and RemoteProtocolError is not among
    # the errors hf_hub_download catches) nor an API call is retried: the client raises httpx2's error unwrapped.
    hub.create_repo("alice/drop-meta")
    hub.inject("HEAD", r"/resolve/", drop_connection=True)
    hub.inject("GET", r"^/api/models/alice/drop-meta$", drop_connection=True)
    code = """
        result([error(lambda: hf_hub_download("alice/drop-meta", ".gitattributes")),
                error(lambda: api.model_info("alice/drop-meta")), api.model_info("alice/drop-meta").id])
    """
    assert client(hub, code, home=tmp_path) == [["RemoteProtocolError", None]] * 2 + ["alice/drop-meta"]


def test_429_retry_after_is_honoured(hub: HubServer, tmp_path: Path) -> None:
    hub.create_repo("alice/limited")
    hub.commit_files("alice/limited", {"config.json": b"{}"})
    hub.inject("GET", r"/resolve/", status=429, retry_after=1)
    code = """
        start = time.monotonic()
        hf_hub_download("alice/limited", "config.json")
        result(time.monotonic() - start)
    """
    elapsed = client(hub, code, home=tmp_path)
    assert elapsed >= 2.0  # Retry-After 1 s + the client's own 1 s margin (its default backoff would be 1 s)
    assert [s.status for s in hub.seen if s.method == "GET"] == [429, 200]


def test_lfs_put_500_is_retried_and_api_500_is_not(hub: HubServer, tmp_path: Path) -> None:
    hub.create_repo("alice/retry-up")
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"\0" * 1000)
    hub.inject("PUT", r"^/_lfs/", status=500)
    hub.inject("GET", r"^/api/models/alice/retry-up$", status=500)
    code = f"""
        info = error(lambda: api.model_info("alice/retry-up"))
        up = api.upload_file(path_or_fileobj={str(weights)!r}, path_in_repo="w.safetensors", repo_id="alice/retry-up")
        result([info, up.oid])
    """
    info_error, oid = client(hub, code, token=ALICE)
    assert info_error == ["HfHubHTTPError", 500] and oid == hub.head("alice/retry-up")
    assert [s.status for s in hub.seen if s.method == "PUT"] == [500, 200]
    assert hub.files("alice/retry-up")["w.safetensors"].lfs


def test_space_upload_and_download(hub: HubServer, tmp_path: Path) -> None:
    app = tmp_path / "app"
    app.mkdir()
    (app / "app.py").write_text("import gradio\n")
    code = f"""
        api.create_repo("alice/demo", repo_type="space", space_sdk="gradio", exist_ok=True)
        api.upload_folder(repo_id="alice/demo", repo_type="space", folder_path={str(app)!r})
        path = hf_hub_download("alice/demo", "app.py", repo_type="space")
        result([open(path).read(), api.space_info("alice/demo").sha])
    """
    content, sha = client(hub, code, token=ALICE, home=tmp_path / "home")
    assert content == "import gradio\n" and sha == hub.head("alice/demo", repo_type="space")
    assert ("POST", "/api/spaces/alice/demo/commit/main") in hub.requests
    assert any(r[1].startswith("/spaces/alice/demo/resolve/") for r in hub.requests)


def test_state_survives_restart_and_tokens_are_never_logged(
    hub: HubServer, model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="converter.testing.hub")
    hub.create_repo("alice/logged")
    client(hub, f'result(api.upload_folder(repo_id="alice/logged", folder_path={str(model_dir)!r}).oid)', token=ALICE)
    assert "/api/models/alice/logged/commit/main" in caplog.text  # requests are logged ...
    assert ALICE not in caplog.text  # ... without their Authorization header
    on_disk = b"".join(p.read_bytes() for p in hub.root.rglob("*.json"))
    assert ALICE.encode() not in on_disk

    reopened = HubServer(hub.root)  # not started: reads the same root
    assert reopened.head("alice/logged") == hub.head("alice/logged")
    assert [c.sha for c in reopened.history("alice/logged")] == [c.sha for c in hub.history("alice/logged")]
    assert reopened.read_file("alice/logged", "config.json") == (model_dir / "config.json").read_bytes()
