"""The options objects of extract / resize / combine: the command line fills every field from the option of the
same name (nothing listed twice, nothing lost), and each object checks itself when built."""

from __future__ import annotations

from dataclasses import fields

import pytest

from converter.cli.commands import build_parser
from converter.cli.options import options_from
from converter.errors import UsageError
from converter.methods.options import CombineOptions, ExtractOptions, ResizeOptions

COMMAND_LINES = {
    ExtractOptions: ["extract", "--base", "b", "--tuned", "t", "--out", "o", "--rank", "8", "--rank-rule", "sv_fro",
                     "--rank-param", "0.9", "--include", "q_proj", "--exclude", "k_proj", "--no-modules-to-save",
                     "--to", "kohya", "--force", "--allow-pickle"],
    ResizeOptions: ["resize", "--adapter", "a", "--out", "o", "--rank", "4", "--rank-rule", "sv_ratio",
                    "--rank-param", "2", "--base", "b", "--component", "unet", "--to", "diffusers", "--force",
                    "--allow-pickle"],
    CombineOptions: ["combine", "--adapter", "a", "--adapter", "b", "--out", "o", "--weight", "0.5", "--weight", "2",
                     "--method", "ties_svd", "--density", "0.3", "--rank", "6", "--seed", "7", "--majority-sign",
                     "frequency", "--svd-clamp", "0.99", "--base", "m", "--component", "unet", "--allow-pickle",
                     "--to", "kohya", "--force"],
}  # fmt: skip


@pytest.mark.parametrize("cls", COMMAND_LINES, ids=lambda c: c.__name__)
def test_every_field_comes_from_the_command_line(cls):
    options = options_from(cls, build_parser().parse_args(COMMAND_LINES[cls]))
    defaults = cls(**({"rank": 1} if cls is not CombineOptions else {}))
    unset = [f.name for f in fields(cls) if getattr(options, f.name) == getattr(defaults, f.name)]
    assert unset == [], f"{cls.__name__}: no option on the command line sets {unset}"


def test_the_values_arrive_as_given():
    options = options_from(CombineOptions, build_parser().parse_args(COMMAND_LINES[CombineOptions]))
    assert options.weights == (0.5, 2.0) and options.sign_method == "frequency" and options.density == 0.3
    assert options.weights_for(["a", "b"]) == [0.5, 2.0]
    assert CombineOptions().weights_for(["a", "b", "c"]) == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    "build, words",
    [
        (lambda: ExtractOptions(rank=0), "--rank 0"),
        (lambda: ResizeOptions(rank=4, rule="sv_fro"), "needs --rank-param"),
        (lambda: ExtractOptions(rank=4, to="gguf"), "--to gguf"),
        (lambda: CombineOptions(method="ties"), "needs --density"),
        (lambda: CombineOptions(method="cat", rank=4), "svd methods only"),
        (lambda: CombineOptions(sign_method="mean"), "--majority-sign mean"),
        (lambda: CombineOptions(weights=(1.0,)).weights_for(["a", "b"]), "1 --weight for 2 --adapter"),
    ],
)
def test_an_option_that_cannot_work_is_refused_when_built(build, words):
    with pytest.raises(UsageError, match=words.replace("-", r"\-")):
        build()
