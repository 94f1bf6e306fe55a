"""The plugin inside the real SGLang 0.5.23: entry point, registry, argument handling and start-up checks."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ddtree.models.default import default_drafter, default_target
from tests.sglang.support import requires_sglang

pytestmark = requires_sglang

PROBE = """
import json, sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
algo = SpeculativeAlgorithm.from_string(sys.argv[1])
print(json.dumps({"type": type(algo).__name__, "dflash": algo.is_dflash(), "topk": algo.need_topk(),
                  "hidden": algo.carries_draft_hidden_states(), "overlap": algo.supports_overlap}))
"""


def test_the_entry_point_is_installed() -> None:
    from importlib.metadata import entry_points

    found = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert found.get("ddtree") == "ddtree.sglang.plugin:register"


def test_sglangs_loader_registers_ddtree_in_a_fresh_process() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE, "ddtree"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"type": "DDTreeSpecAlgo", "dflash": True, "topk": False, "hidden": False, "overlap": True}


def test_the_loader_honours_sglang_plugins_whitelist() -> None:
    env = {**__import__("os").environ, "SGLANG_PLUGINS": "someone_else"}
    out = subprocess.run([sys.executable, "-c", PROBE, "ddtree"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode != 0 and "Unknown speculative algorithm" in out.stderr


@pytest.fixture(scope="module")
def loaded() -> None:
    import os

    os.environ["DDTREE_SGLANG_CPU"] = "1"
    from sglang.srt.plugins import load_plugins

    load_plugins()


def resolve(loaded: None, **overrides: Any) -> Any:
    """Run SGLang's server-argument resolution for DDTREE on CPU; return the server arguments."""
    from sglang.srt.arg_groups.pipeline import run_resolution_pipeline
    from sglang.srt.server_args import ServerArgs

    args = {
        "model_path": str(default_target(quiet=True)),
        "device": "cpu",
        "speculative_algorithm": "DDTREE",
        "speculative_draft_model_path": str(default_drafter()),
        "attention_backend": "torch_native",
    } | overrides
    server_args = ServerArgs(**args)
    run_resolution_pipeline(server_args)
    return server_args


def test_server_args_resolve_like_dflash(loaded: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.arg_groups.overrides import max_speculative_num_draft_tokens, resolving_view

    monkeypatch.setenv("SGLANG_DDTREE_BUDGET", "32")
    server_args = resolve(loaded)
    cfg = resolving_view(server_args)
    assert cfg.speculative_num_draft_tokens == 16  # the drafter's block
    assert cfg.speculative_draft_attention_backend == "torch_native"
    assert max_speculative_num_draft_tokens(server_args) == 16 + 33  # block + tree width


# trtllm_mha is refused by SGLang itself on a machine without a Hopper or Blackwell GPU, before DDTREE's check
# runs; `test_config.py` covers DDTREE's check for it.
@pytest.mark.parametrize("backend", ["fa3", "fa4"])
def test_start_up_refuses_maskless_backends(loaded: None, backend: str) -> None:
    from ddtree.sglang.config import DDTreeConfigError

    with pytest.raises(DDTreeConfigError, match=backend):
        resolve(loaded, attention_backend=backend)


def test_start_up_refuses_a_tree_as_wide_as_the_block(loaded: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from ddtree.sglang.config import DDTreeConfigError

    monkeypatch.setenv("SGLANG_DDTREE_BUDGET", "15")
    with pytest.raises(DDTreeConfigError, match="block size"):
        resolve(loaded)


def test_start_up_refuses_the_chain_only_linear_verify(loaded: None) -> None:
    from ddtree.sglang.config import DDTreeConfigError

    with pytest.raises(DDTreeConfigError, match="enable-linear-replayssm-spec"):
        resolve(loaded, enable_linear_replayssm_spec=True)


@pytest.mark.parametrize(
    ("change", "head"),
    [
        ({"architectures": ["DFlash2DraftModel"]}, "candidate-selector"),
        ({"architectures": ["LiLiCorrDraftModel"]}, "LiLiCorr"),
        (
            {
                "dflash_config": {
                    "projector_type": "domino",
                    "shift_label": True,
                    "gru_hidden_dim": 64,
                    "emb_dim": 64,
                    "pure_draft_prefix_len": 1,
                }
            },
            "Domino",
        ),
    ],
)
def test_start_up_refuses_drafters_with_extra_heads(
    loaded: None, tmp_path: Path, change: dict[str, Any], head: str
) -> None:
    from ddtree.sglang.config import DDTreeConfigError

    drafter = tmp_path / "drafter"
    shutil.copytree(default_drafter(), drafter)
    config = json.loads((drafter / "config.json").read_text())
    for key, value in change.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    (drafter / "config.json").write_text(json.dumps(config))
    with pytest.raises(DDTreeConfigError, match=head):
        resolve(loaded, speculative_draft_model_path=str(drafter))


def test_hybrids_are_told_apart_by_sglangs_own_test(loaded: None) -> None:
    """SGLang's `mambaish_config` of a target, as the worker checks it at start-up: the gated-delta-net
    hybrids pass, a Mamba2 hybrid is refused."""
    from sglang.srt.configs import Mamba2Config
    from sglang.srt.configs.hybrid_arch import mambaish_config
    from sglang.srt.configs.qwen3_5 import Qwen3_5TextConfig
    from sglang.srt.configs.qwen3_next import Qwen3NextConfig
    from transformers import LlamaConfig

    from ddtree.sglang.config import DDTreeConfigError, check_hybrid

    def model_config(hf: Any) -> Any:
        return SimpleNamespace(hf_config=hf, linear_attn_registry_result=None, is_draft_model=False)

    check_hybrid(mambaish_config(model_config(LlamaConfig())))
    for gdn in (Qwen3NextConfig(), Qwen3_5TextConfig()):
        assert mambaish_config(model_config(gdn)) is not None
        check_hybrid(mambaish_config(model_config(gdn)))
    with pytest.raises(DDTreeConfigError, match="Mamba2Config"):
        check_hybrid(mambaish_config(model_config(Mamba2Config())))


@pytest.mark.parametrize(("algorithm", "deduplicated"), [("DDTREE", False), ("DFLASH", True)])
def test_ddtree_keeps_one_convolution_window_per_tree_node(loaded: None, algorithm: str, deduplicated: bool) -> None:
    """The memory pool's layout question for a CUDA GDN target at top-k 1, asked as the scheduler asks it: DDTREE
    has the plugin's answer, other algorithms SGLang's; with no configuration published yet, SGLang's."""
    from sglang.srt.mem_cache import memory_pool
    from sglang.srt.runtime_context import create_context, use_context

    def ask() -> bool:
        return bool(memory_pool.conv_window_dedup_enabled(False, False, 1, False))

    server_args = resolve(loaded, speculative_algorithm=algorithm)
    with use_context(create_context(server_args, role="scheduler")):
        assert ask() is deduplicated
    assert ask() is True


def test_cpu_mode_refuses_other_sglang_versions() -> None:
    from ddtree.sglang.cpu import check_version

    check_version()  # the installed 0.5.23
    with pytest.raises(RuntimeError, match=r"0\.5\.23"):
        check_version("0.5.24")
