"""Keymaps are data: every shipped file follows the schema, each kind of mistake is a one-line error naming the
file and the key, and the files travel with the package (a built wheel, a deployed Space)."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from converter.app.deploy import space_files
from converter.engine.keymap import all_keymaps, keymap_folder, load_keymap
from converter.engine.keymap_schema import KeymapError
from converter.errors import ConverterError

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "keymaps").glob("*.yaml"))


def test_every_shipped_keymap_follows_the_schema():
    assert len(SHIPPED) >= 13 and not (ROOT / "converter" / "keymaps").exists()  # data lives at the top level
    loaded = [load_keymap(f"keymaps/{p.name}", p.read_text()) for p in SHIPPED]
    assert [k.name for k in loaded] == [p.stem for p in SHIPPED]
    assert [k.name for k in all_keymaps()] == [p.stem for p in SHIPPED]
    assert Path(str(keymap_folder())) == ROOT / "keymaps"  # a checkout reads its own files


def _data(name: str) -> dict:
    return yaml.safe_load((ROOT / "keymaps" / f"{name}.yaml").read_text())


def _mutate(name: str, change) -> str:
    data = copy.deepcopy(_data(name))
    change(data)
    return yaml.safe_dump(data, sort_keys=False)


MISTAKES = {
    # kind of mistake: (keymap, change, what the message must say)
    "unknown top-level key": ("generic", lambda d: d.update(prefixs=d.pop("prefixes")),
                              r"keymaps/generic\.yaml: prefixs: unknown key \(did you mean 'prefixes'\?"),
    "unknown nested key": ("phi3", lambda d: d["fused"][0].update(modul=d["fused"][0].pop("module")),
                           r"keymaps/phi3\.yaml: fused\[0\]\.modul: unknown key \(did you mean 'module'\?"),
    "unknown key in an alias target": ("flux", lambda d: d["aliases"]["transformer"].append(
        {"from": "x", "to": {"key": "y", "row": [0, 1]}}),
        r"keymaps/flux\.yaml: aliases\.transformer\[\d+\]\.to\.row:"),
    "wrong type (string for a list)": ("generic", lambda d: d.update(model_types="llama"),
                                       r"keymaps/generic\.yaml: model_types: expected a list, got a string"),
    "wrong type (prefix not a pair)": ("generic", lambda d: d["prefixes"].append(["a", "b", "c"]),
                                       r"keymaps/generic\.yaml: prefixes\[2\]: expected a list of two values"),
    "wrong type (tied head to a list)": ("gpt2", lambda d: d.update(tied={"lm_head.weight": ["a"]}),
                                         r"keymaps/gpt2\.yaml: tied\.lm_head\.weight: expected a string, got a list"),
    "wrong type (table key)": ("sd3", lambda d: d["tables"]["qkv"].update({0: "x"}),
                               r"keymaps/sd3\.yaml: tables\.qkv key: expected a string"),
    "empty value": ("generic", lambda d: d.update(tied=None), r"keymaps/generic\.yaml: tied: expected a mapping"),
    "bad regular expression": ("gpt2", lambda d: d.update(stored_transposed=["(c_attn"]),
                               r"keymaps/gpt2\.yaml: stored_transposed\[0\]: not a valid regular expression"),
    "missing required name": ("generic", lambda d: d.pop("name"),
                              r"keymaps/generic\.yaml: missing required key 'name'"),
    "missing required model_types": ("sd", lambda d: d.pop("model_types"),
                                     r"keymaps/sd\.yaml: missing required key 'model_types'"),
    "missing required alias target": ("sdxl", lambda d: d["aliases"]["unet"][0].pop("to"),
                                      r"keymaps/sdxl\.yaml: aliases\.unet\[0\]: missing required key 'to'"),
    "name differs from the file": ("generic", lambda d: d.update(name="generik"),
                                   r"keymaps/generic\.yaml: name 'generik' differs from the file name"),
    "unknown spelling in loaders": ("flux2", lambda d: d["loaders"]["diffusers"].append("kohya/orginal"),
                                    r"keymaps/flux2\.yaml: loaders\.diffusers\[\d+\]: expected a spelling"),
    "unknown tool in loaders": ("flux2", lambda d: d["loaders"].update(a1111=["kohya"]),
                                r"keymaps/flux2\.yaml: loaders\.a1111: unknown key \(allowed: diffusers, comfyui"),
    "unknown naming in names": ("wan", lambda d: d["names"].update(comfy=["x"]),
                                r"keymaps/wan\.yaml: names\.comfy: unknown key \(allowed: original, diffusers"),
    "shape rule without its condition": ("flux2", lambda d: d["shapes"][0].pop("when"),
                                         r"keymaps/flux2\.yaml: shapes\[0\]: missing required key 'when'"),
    "target spelling": ("z_image", lambda d: d["targets"].update(comfyui="comfy"),
                        r"keymaps/z_image\.yaml: targets\.comfyui: expected a spelling"),
    "unknown spelling in lokr_loaders": ("z_image", lambda d: d["lokr_loaders"]["diffusers"].append("lyco"),
                                         r"keymaps/z_image\.yaml: lokr_loaders\.diffusers\[\d+\]: expected a spelling"),
    "diffusers' other loaders as a string": ("wan", lambda d: d["diffusers"].update(also="HeliosLoraLoaderMixin"),
                                             r"keymaps/wan\.yaml: diffusers\.also: expected a list"),
}  # fmt: skip


@pytest.mark.parametrize("kind", MISTAKES)
def test_each_kind_of_mistake_is_a_one_line_error(kind):
    name, change, message = MISTAKES[kind]
    load_keymap(f"keymaps/{name}.yaml", _mutate(name, lambda d: None))  # the unchanged file loads
    with pytest.raises(KeymapError, match=message) as err:
        load_keymap(f"keymaps/{name}.yaml", _mutate(name, change))
    assert isinstance(err.value, ConverterError) and "\n" not in str(err.value)


def test_not_yaml_or_not_a_mapping():
    with pytest.raises(KeymapError, match=r"keymaps/x\.yaml: not valid YAML"):
        load_keymap("keymaps/x.yaml", "name: [unclosed")
    with pytest.raises(KeymapError, match=r"keymaps/x\.yaml: expected a mapping, got a list"):
        load_keymap("keymaps/x.yaml", "- name: x")


def test_integers_are_accepted_where_expressions_are_expected():
    """`layers_per_block: 2` and `rows: [0, 4]` mean the same as their quoted forms."""
    data = _data("sdxl")
    data["defaults"] = {"layers_per_block": 2}
    km = load_keymap("keymaps/sdxl.yaml", yaml.safe_dump(data))
    assert km.defaults == {"layers_per_block": "2"}


def test_a_bad_shipped_file_stops_loading(tmp_path, monkeypatch):
    """all_keymaps validates every file it ships: one misspelt key anywhere is an error, not a silent default."""
    for p in SHIPPED:
        shutil.copy(p, tmp_path / p.name)
    (tmp_path / "gpt2.yaml").write_text((tmp_path / "gpt2.yaml").read_text().replace("tied:", "tide:"))
    monkeypatch.setattr("converter.engine.keymap.keymap_folder", lambda: tmp_path)
    with pytest.raises(KeymapError, match=r"keymaps/gpt2\.yaml: tide: unknown key \(did you mean 'tied'\?"):
        all_keymaps.__wrapped__()


def _load_from(path: Path) -> str:
    """keymap_folder() and the keymap names as seen by a Python whose only converter is the one under `path`."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(path)}
    code = "from converter.engine.keymap import all_keymaps, keymap_folder; print(keymap_folder()); " \
           "print(' '.join(k.name for k in all_keymaps()))"  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], cwd=path, env=env, capture_output=True, text=True, check=True)
    return out.stdout


def test_a_built_wheel_ships_the_keymaps_inside_the_package(wheel, tmp_path):
    """converter's wheel, built from this checkout (the session's `wheel`, the one installed into fresh venvs)."""
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for p in SHIPPED:
            assert z.read(f"converter/keymaps/{p.name}") == p.read_bytes()
        modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "converter").rglob("*.py")}
        assert modules <= names  # every subpackage is listed in pyproject
        z.extractall(tmp_path / "installed")
    folder, loaded = _load_from(tmp_path / "installed").splitlines()
    assert Path(folder) == tmp_path / "installed" / "converter" / "keymaps"
    assert loaded.split() == [p.stem for p in SHIPPED]


def test_space_deploy_uploads_the_keymaps_where_the_deployed_package_finds_them(tmp_path):
    files = space_files(ROOT)  # exactly what `converter space deploy` commits, path in the Space -> local file
    assert {f"converter/keymaps/{p.name}" for p in SHIPPED} <= set(files)
    assert "converter/gguf/pretokenizers.json" in files  # the Space's GGUF choice names BPE pre-tokenizers by it
    space = tmp_path / "space"
    for name, local in files.items():
        (space / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(local, space / name)
    folder, loaded = _load_from(space).splitlines()
    assert Path(folder) == space / "converter" / "keymaps"
    assert loaded.split() == [p.stem for p in SHIPPED]
