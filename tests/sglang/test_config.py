"""DDTREE's settings and start-up checks (pure Python: run without SGLang)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ddtree.sglang.config import (
    DEFAULT_BUDGET,
    DDTreeConfigError,
    DDTreeSettings,
    check_attention_backends,
    check_drafter,
    check_hybrid,
    check_linear_verify,
    check_tree_width,
    drafter_heads,
)


def test_settings_from_env() -> None:
    assert DDTreeSettings.from_env({}) == DDTreeSettings(DEFAULT_BUDGET, None)
    got = DDTreeSettings.from_env({"SGLANG_DDTREE_BUDGET": "8", "SGLANG_DDTREE_TOPK": "1"})
    assert (got.budget, got.topk, got.width) == (8, 1, 9)


@pytest.mark.parametrize("raw", ["0", "-3", "eight", "1.5"])
@pytest.mark.parametrize("name", ["SGLANG_DDTREE_BUDGET", "SGLANG_DDTREE_TOPK"])
def test_bad_settings_name_the_variable(name: str, raw: str) -> None:
    with pytest.raises(DDTreeConfigError, match=name):
        DDTreeSettings.from_env({name: raw})


@pytest.mark.parametrize("backend", ["fa3", "trtllm_mha", "fa4"])
@pytest.mark.parametrize("field", ["attention_backend", "decode_attention_backend", "prefill_attention_backend"])
def test_backends_that_ignore_tree_masks_are_refused(field: str, backend: str) -> None:
    with pytest.raises(DDTreeConfigError, match=backend):
        check_attention_backends(SimpleNamespace(**{field: backend}))


@pytest.mark.parametrize("backend", [None, "flashinfer", "triton", "torch_native"])
def test_backends_with_masks_pass(backend: str | None) -> None:
    check_attention_backends(SimpleNamespace(attention_backend=backend, decode_attention_backend=backend))


def test_a_tree_as_wide_as_the_block_is_refused() -> None:
    with pytest.raises(DDTreeConfigError, match="block size"):
        check_tree_width(DDTreeSettings(budget=15), block_size=16)
    check_tree_width(DDTreeSettings(budget=14), block_size=16)
    check_tree_width(DDTreeSettings(budget=16), block_size=16)


@pytest.mark.parametrize(
    ("architectures", "rank", "projector", "head"),
    [
        (["DFlash2DraftModel"], 0, None, "candidate-selector"),
        (["DFlashDraftModel"], 8, None, "candidate-selector"),
        (["LiLiCorrDraftModel"], 0, None, "LiLiCorr"),
        (["DFlashDraftModel"], 0, "domino", "Domino"),
    ],
)
def test_drafters_with_extra_heads_are_refused(
    architectures: list[str], rank: int, projector: str | None, head: str
) -> None:
    heads = drafter_heads(architectures, rank, projector)
    assert heads == [head]
    with pytest.raises(DDTreeConfigError, match=head):
        check_drafter(heads)


def test_a_plain_drafter_passes() -> None:
    assert drafter_heads(["DFlashDraftModel"], 0, None) == []
    check_drafter([])


@pytest.mark.parametrize("name", ["Qwen3NextConfig", "Qwen3_5TextConfig", "Qwen3_5MoeTextConfig"])
def test_gated_delta_net_hybrids_pass(name: str) -> None:
    check_hybrid(type(name, (), {})())
    check_hybrid(None)  # a dense target


@pytest.mark.parametrize("name", ["Mamba2Config", "NemotronHConfig", "Lfm2Config", "KimiLinearConfig"])
def test_other_hybrids_are_refused_naming_the_supported_ones(name: str) -> None:
    with pytest.raises(DDTreeConfigError, match=rf"{name}.*") as refused:
        check_hybrid(type(name, (), {})())
    message = str(refused.value)
    assert "Qwen3-Next" in message and "Qwen3.5" in message and "\n" not in message


def test_a_chain_only_linear_verify_is_refused() -> None:
    with pytest.raises(DDTreeConfigError, match="enable-linear-replayssm-spec"):
        check_linear_verify(True)
    check_linear_verify(False)


def test_the_package_imports_without_sglang() -> None:
    """Everything but the worker, the spec and the CPU patches imports with SGLang absent (it is made unimportable
    here), so the main package and its CLI never need it."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['sglang'] = None\n"
        "import ddtree, ddtree.cli, ddtree.sglang, ddtree.sglang.config, ddtree.sglang.tree_step\n"
        "import ddtree.sglang.plugin, ddtree.sglang.cpu_attention, ddtree.sglang.cpu_gdn, ddtree.sglang.hybrid\n"
        "assert sys.modules['sglang'] is None\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
