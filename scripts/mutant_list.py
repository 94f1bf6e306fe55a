"""The named mutants of `scripts/mutants.py`: each a piece of source text replaced (or a few, for one idea)
in one file, and the test files that should notice."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    path: str
    edits: tuple[tuple[str, str], ...]  # (old, new): each old occurs exactly once in the file
    tests: tuple[str, ...]


TREE = ("tests/ddtree/test_tree.py",)
LOSSLESS = ("tests/ddtree/test_accept.py", "tests/ddtree/test_kv_cache.py", "tests/ddtree/engine/test_lossless.py")
SAMPLING = ("tests/ddtree/test_sampling.py",)
FLOOR = ("tests/ddtree/models/test_acceptance_floor.py",)
RECONCILE = ("tests/telemetry/test_reconcile.py", "tests/telemetry/test_collector.py")
ZERO_SYNC = ("tests/telemetry/test_zero_sync.py",)
ATTENTION = ("tests/ddtree/kernels/test_tree_attention.py",)
ANCESTORS = ("tests/ddtree/kernels/test_ancestors.py",)
TREE_KERNELS = ("tests/ddtree/kernels/test_tree_build.py",)
SCHEDULE = ("tests/ddtree/engine/test_schedule.py", "tests/ddtree/server/test_auto_budget.py")
HYBRID = ("tests/ddtree/models/test_hybrid.py", "tests/ddtree/models/test_gdn.py")
PROBE = (
    "tests/ddtree/engine/test_probe.py",
    "tests/ddtree/engine/test_session.py",
    "tests/telemetry/test_collector.py",
)


def mutants() -> list[Mutant]:
    return [
        Mutant(
            "tree-prefix-not-a-product",
            "a prefix scores by its last token alone, not the product along its path",
            "ddtree/tree.py",
            (
                (
                    "cand = level_lp[:, :, None] + step",
                    "cand = 0 * level_lp[:, :, None] + step",
                ),
            ),
            TREE,
        ),
        Mutant(
            "tree-one-candidate-per-depth",
            "top-k forced to 1: the tree degenerates to a chain",
            "ddtree/tree.py",
            (
                (
                    "return batch, depth, vocab, min(budget, vocab) if topk is None else topk",
                    "return batch, depth, vocab, 1 if topk is None else topk",
                ),
            ),
            TREE,
        ),
        Mutant(
            "mask-parent-only",
            "the tree mask without the ancestor closure: a node sees its parent and itself only",
            "ddtree/tree.py",
            (("    while hops < width:", "    while hops < 1:"),),
            LOSSLESS,
        ),
        Mutant(
            "verify-flat-positions",
            "every tree node verified at the root's position instead of start + depth",
            "ddtree/engine/step.py",
            (
                (
                    "positions = r.cache.lengths[:, None] + tree.depths",
                    "positions = r.cache.lengths[:, None] + 0 * tree.depths",
                ),
            ),
            LOSSLESS,
        ),
        Mutant(
            "accept-on-own-match",
            "a node is accepted when its own token matches, whatever happened to its ancestors",
            "ddtree/accept.py",
            (("accepted_nodes = ~(ancestors & ~match[:, None, :]).any(dim=-1)", "accepted_nodes = match.clone()"),),
            LOSSLESS,
        ),
        Mutant(
            "accept-bonus-at-root",
            "the bonus token is the target's choice at the root, not after the last accepted node",
            "ddtree/accept.py",
            (("bonus = target_tokens.gather(1, last).squeeze(1)", "bonus = target_tokens[:, 0]"),),
            LOSSLESS,
        ),
        Mutant(
            "kv-keys-not-compacted",
            "the accept step compacts the values to the accepted path but leaves the keys where they were",
            "ddtree/kv_cache.py",
            (("for store in (self.keys, self.values):", "for store in (self.values,):"),),
            LOSSLESS,
        ),
        Mutant(
            "kv-commits-one-more",
            "the cache commits one token more than was accepted",
            "ddtree/kv_cache.py",
            (("self.lengths += advance", "self.lengths += advance + (advance > 0).long()"),),
            LOSSLESS,
        ),
        Mutant(
            "sampling-temperature-twice",
            "logits divided by the temperature twice (the same as once at T = 1)",
            "ddtree/sampling.py",
            (
                (
                    "torch.softmax(logits.float() / scale, dim=-1)",
                    "torch.softmax(logits.float() / scale / scale, dim=-1)",
                ),
            ),
            SAMPLING,
        ),
        Mutant(
            "sampling-temperature-ignored",
            "logits not divided by the temperature at all",
            "ddtree/sampling.py",
            (("torch.softmax(logits.float() / scale, dim=-1)", "torch.softmax(logits.float(), dim=-1)"),),
            SAMPLING,
        ),
        Mutant(
            "drafter-context-wrong-rows",
            "the drafter gets the target features of the first tree nodes, not of the accepted path (lossless)",
            "ddtree/engine/step.py",
            (
                (
                    "index = result.path[:, :, None].expand(-1, -1, s.features.shape[-1])",
                    "index = torch.arange(result.path.shape[1])[None, :, None].expand("
                    "result.path.shape[0], -1, s.features.shape[-1])",
                ),
            ),
            FLOOR,
        ),
        Mutant(
            "log-nodes-per-depth-shifted",
            "the step log's nodes_per_depth starts at depth 0",
            "telemetry/logging.py",
            (("stats.nodes_per_depth[1 : depth + 1]", "stats.nodes_per_depth[0:depth]"),),
            RECONCILE,
        ),
        Mutant(
            "log-accepted-per-depth-shifted",
            "the step log's accepted_per_depth starts at depth 0",
            "telemetry/logging.py",
            (("stats.accepted_per_depth[1 : depth + 1]", "stats.accepted_per_depth[0:depth]"),),
            RECONCILE,
        ),
        Mutant(
            "metric-nodes-per-depth-off-by-one",
            "ddtree_tree_nodes_per_depth_total{depth=d} counts the nodes of depth d-1",
            "telemetry/metrics.py",
            (("+= stats.nodes_per_depth[depth]", "+= stats.nodes_per_depth[depth - 1]"),),
            RECONCILE,
        ),
        Mutant(
            "metric-tree-size-histogram-off-by-one",
            "the ddtree_tree_nodes histogram records one node more than the tree has",
            "telemetry/metrics.py",
            (("self.tree_nodes.record(nodes, attributes)", "self.tree_nodes.record(nodes + 1, attributes)"),),
            RECONCILE,
        ),
        Mutant(
            "metric-served-name-renamed",
            "the steps counter served under another name than the dashboards query",
            "telemetry/semconv.py",
            (('METRIC_STEPS: Final = "ddtree_steps"', 'METRIC_STEPS: Final = "ddtree_decode_steps"'),),
            ("tests/dashboards/test_dashboards.py",),
        ),
        Mutant(
            "span-mean-acceptance-off-by-one",
            "the step span's mean acceptance length forgets the bonus token",
            "telemetry/tracing.py",
            (("lengths = [n + 1 for n in stats.accepted]", "lengths = [n for n in stats.accepted]"),),
            RECONCILE,
        ),
        Mutant(
            "stage-times-whole-step",
            "every stage reported with its whole step's start and end",
            "telemetry/collector.py",
            (("{s: (wall[i], wall[j]) for s, (i, j)", "{s: (wall[0], wall[-1]) for s, (i, j)"),),
            RECONCILE,
        ),
        Mutant(
            "outbox-drops-uncounted",
            "a step record refused by the full telemetry queue is dropped without being counted",
            "telemetry/outbox.py",
            (("                self._drop([item])\n                return\n", "                return\n"),),
            ("tests/telemetry/test_stall.py::test_a_stalled_log_pipe_costs_counted_records_never_a_stalled_step",),
        ),
        Mutant(
            "otlp-drops-counted-per-batch",
            "a failed span export counts one drop per batch instead of one per span",
            "telemetry/sinks.py",
            (("self.counter.add(len(spans))", "self.counter.add(1)"),),
            (
                "tests/telemetry/test_export.py::test_an_unreachable_endpoint_costs_no_tokens_and_its_drops_are_counted_and_logged_once",
            ),
        ),
        Mutant(
            "shutdown-unbounded",
            "shutdown waits for the exporter process however long a silent endpoint keeps it",
            "telemetry/setup.py",
            (("worker.join(timeout_s)", "worker.join()"),),
            ("tests/telemetry/test_export.py::test_shutdown_with_a_silent_endpoint_keeps_its_promised_bound",),
        ),
        Mutant(
            "nvml-power-in-milliwatts",
            "the GPU power gauge reports NVML's milliwatts as watts",
            "telemetry/nvml.py",
            (("power = nvml.nvmlDeviceGetPowerUsage(handle) / 1000", "power = nvml.nvmlDeviceGetPowerUsage(handle)"),),
            ("tests/telemetry/test_nvml.py",),
        ),
        Mutant(
            "zero-sync-blocking-depth-copy",
            "the collector copies the tree's depths to the host with a blocking copy",
            "telemetry/collector.py",
            (("host.copy_(tree.depths, non_blocking=True)", "host.copy_(tree.depths, non_blocking=False)"),),
            ZERO_SYNC,
        ),
        Mutant(
            "zero-sync-accepted-from-device",
            "the collector reads the accepted counts from the device result instead of the host copy",
            "telemetry/collector.py",
            (("self.started[step].accepted = accepted", "self.started[step].accepted = result.accepted.tolist()"),),
            ZERO_SYNC,
        ),
        Mutant(
            "zero-sync-synchronize-if-cuda",
            "the collector waits for the device at every step end, behind torch.cuda.is_available()",
            "telemetry/collector.py",
            (
                (
                    "        record = self.started.pop(step)\n",
                    "        record = self.started.pop(step)\n"
                    "        if torch.cuda.is_available():\n"
                    "            torch.cuda.synchronize()\n",
                ),
            ),
            ZERO_SYNC,
        ),
        Mutant(
            "attention-tree-mask-ignored",
            "the Triton tree attention lets every tree token see all of this forward's tokens",
            "ddtree/kernels/_tree_attention_triton.py",
            (
                (
                    "allowed = tl.load(vis_ptrs, mask=row_ok[:, None] & j_ok[None, :], other=0) != 0",
                    "allowed = row_ok[:, None] & j_ok[None, :]",
                ),
            ),
            ATTENTION,
        ),
        Mutant(
            "attention-prefix-one-short",
            "the Triton tree attention misses the last committed slot",
            "ddtree/kernels/_tree_attention_triton.py",
            (("        kv_ok = slot < length\n", "        kv_ok = slot < length - 1\n"),),
            ATTENTION,
        ),
        Mutant(
            "vocab-rows-slow-path-drops-a-tie",
            "the row kernel's exact path keeps one tie too few at the k-th place",
            "ddtree/kernels/_tree_build_triton.py",
            (("t, k - above, dst, CAP, TILE)\n", "t, k - above - 1, dst, CAP, TILE)\n"),),
            TREE_KERNELS,
        ),
        Mutant(
            "ancestors-skip-self",
            "the Triton ancestor matrix leaves out each node itself",
            "ddtree/kernels/_ancestors_triton.py",
            (("tl.uint8), mask=ok)\n", "tl.uint8), mask=ok & (cur != i))\n"),),
            ANCESTORS,
        ),
        Mutant(
            "probe-parents-for-tokens",
            "the readback's probe carries the tree's parents where its tokens belong",
            "ddtree/engine/probe.py",
            (
                (
                    "tree.depths.to(torch.int64), tree.tokens.to(torch.int64)",
                    "tree.depths.to(torch.int64), tree.parents.to(torch.int64)",
                ),
            ),
            PROBE,
        ),
        Mutant(
            "draft-head-one-depth-short",
            "the drafter's head skips the deepest depth the tree can reach",
            "ddtree/engine/proposers.py",
            (("hidden[:, 1 : 1 + self.depth]", "hidden[:, 1 : self.depth]"),),
            ("tests/ddtree/engine/test_proposers.py",),
        ),
        Mutant(
            "capture-lets-the-collector-run",
            "a CUDA graph capture leaves Python's garbage collector on, so it may free another graph mid-capture",
            "ddtree/engine/graphs.py",
            (("    gc.disable()\n", "    pass\n"),),
            ("tests/ddtree/engine/test_graphs.py",),
        ),
        Mutant(
            "stamps-not-offsets",
            "stage times from device stamps skip the subtraction of the step's first stamp",
            "telemetry/collector.py",
            (
                (
                    "wall = [record.wall_ns + (t - stamps[0]) for t in stamps]",
                    "wall = [record.wall_ns + t for t in stamps]",
                ),
            ),
            PROBE,
        ),
        Mutant(
            "recurrent-conv-reads-neighbours",
            "a tree node's convolution reads the nodes before it in the flattened tree, not its ancestors",
            "ddtree/models/recurrent.py",
            (
                (
                    "node = parents.gather(1, node.clamp(min=0)).where(node >= 0, node)  # -1 stays -1",
                    "node = node - 1",
                ),
            ),
            HYBRID,
        ),
        Mutant(
            "recurrent-nodes-step-from-the-committed-state",
            "every tree node's recurrent state steps from the committed state, not from its parent's",
            "ddtree/models/recurrent.py",
            (
                (
                    "before = torch.where((parents >= 0)[(..., *tail)], parent, state[:, None])",
                    "before = state[:, None].expand_as(nodes)",
                ),
            ),
            HYBRID,
        ),
        Mutant(
            "recurrent-commit-steps-the-last-node-only",
            "the commit advances the recurrent state by the accepted path's last node alone",
            "ddtree/models/recurrent.py",
            (
                (
                    "state.copy_(torch.where((j < advance)[(..., *tail)], stepped, state))",
                    "state.copy_(torch.where((j == advance - 1)[(..., *tail)], stepped, state))",
                ),
            ),
            HYBRID,
        ),
        Mutant(
            "teacher-context-sees-the-anchor",
            "the teacher-forced drafter pass lets each block see the target's features of its own anchor",
            "ddtree/train/teacher.py",
            (("block_mask(anchors, keep, ids.shape[1], block)", "block_mask(anchors + 1, keep, ids.shape[1], block)"),),
            ("tests/ddtree/train/test_teacher.py",),
        ),
        Mutant(
            "teacher-walk-drops-the-bonus",
            "the teacher-forced walk starts the next step at the last accepted draft, not past the bonus",
            "ddtree/train/teacher.py",
            (("        j += n + 1\n", "        j += max(n, 1)\n"),),
            ("tests/ddtree/train/test_teacher.py",),
        ),
        Mutant(
            "gdn-kernel-never-reloads-the-parent",
            "the Triton GDN tree kernel continues every node from the node before it, sibling or not",
            "ddtree/kernels/_gdn_tree_triton.py",
            (("        if parent != held:\n", "        if parent < -5:\n"),),
            ("tests/ddtree/kernels/test_gdn_tree.py",),
        ),
        Mutant(
            "gdn-commit-kernel-skips-the-path",
            "the Triton GDN commit leaves the committed state where it was",
            "ddtree/kernels/_gdn_tree_triton.py",
            (("        if j < advance:\n", "        if j < 0:\n"),),
            ("tests/ddtree/kernels/test_gdn_tree.py",),
        ),
        Mutant(
            "ssm-kernel-never-reloads-the-parent",
            "the Triton Mamba2 tree kernel continues every node from the node before it, sibling or not",
            "ddtree/kernels/_ssm_tree_triton.py",
            (("        if parent != held:\n", "        if parent < -5:\n"),),
            ("tests/ddtree/kernels/test_ssm_tree.py",),
        ),
        Mutant(
            "ssm-commit-kernel-skips-the-path",
            "the Triton Mamba2 commit leaves the committed state where it was",
            "ddtree/kernels/_ssm_tree_triton.py",
            (("        if j < advance:\n", "        if j < 0:\n"),),
            ("tests/ddtree/kernels/test_ssm_tree.py",),
        ),
        Mutant(
            "schedule-ar-steps-starve-the-drafter",
            "an ar step of a session whose budget follows the load does not hand the drafter its features",
            "ddtree/engine/proposers.py",
            (("        self.drafter.append_context(context, counts, cache, fused)\n", ""),),
            SCHEDULE,
        ),
        Mutant(
            "schedule-ignores-the-load",
            "every step runs the schedule's widest tree, whatever the rows of the step",
            "ddtree/engine/session.py",
            (
                (
                    "return self.schedule.shape_for(rows)",
                    "return self.shape",
                ),
            ),
            SCHEDULE,
        ),
        Mutant(
            "top-p-keeps-the-boundary-token",
            "top-p keeps one token past the smallest set that reaches p",
            "ddtree/sampling.py",
            (("((before < p * cum[..., -1:]) | (p >= 1))", "((before <= p * cum[..., -1:]) | (p >= 1))"),),
            ("tests/ddtree/test_sampling_filters.py",),
        ),
        Mutant(
            "logprobs-of-the-first-nodes",
            "the emitted tokens' log-probabilities are read at the tree's first nodes, not along the accepted path",
            "ddtree/engine/logprobs.py",
            (("_bits(scores.chosen.gather(1, path)),", "_bits(scores.chosen[:, :width]),"),),
            ("tests/ddtree/engine/test_logprobs.py",),
        ),
        Mutant(
            "step-log-budget-of-the-requests",
            "the exporter logs each step with the requests' budget, not the tree the step verified",
            "telemetry/process.py",
            (
                (
                    "StepStats(step[0], self.info.with_tree(*step[-1]), *step[1:-1])",
                    "StepStats(step[0], self.info, *step[1:-1])",
                ),
            ),
            ("tests/telemetry/analysis/test_switching_log.py",),
        ),
        Mutant(
            "prefill-group-first-token-index",
            "a grouped join hands each request the first token at its index in the whole join, not in its group",
            "ddtree/engine/session.py",
            (
                (
                    "firsts += [(group, i) for i in range(size)]",
                    "firsts += [(group, min(start + i, size - 1)) for i in range(size)]",
                ),
            ),
            ("tests/ddtree/engine/test_session.py",),
        ),
        Mutant(
            "commitment-ignores-the-wait",
            "a window commits by the waited step times alone, as if running unread saved nothing",
            "ddtree/adaptive.py",
            (("/ (len(window) * unwaited[k])", "/ (len(window) * waited[k])"),),
            ("tests/ddtree/test_adaptive.py",),
        ),
        Mutant(
            "fixed-cost-above-waited",
            "a width's fixed-step time counts even where it was measured above its waited time",
            "ddtree/engine/adaptive.py",
            (("[min(fixed.get(w, t), t) for w, t in", "[fixed.get(w, t) for w, t in"),),
            ("tests/ddtree/engine/test_adaptive.py",),
        ),
        Mutant(
            "transition-reads-the-wrong-parent",
            "a conditioned tree's candidates are weighted by the beam's first prefix's token, not their own parent's",
            "ddtree/tree.py",
            (
                (
                    "transition.condition(top_lp[:, d], top_ids[:, d], level_tok)",
                    "transition.condition(top_lp[:, d], top_ids[:, d], level_tok[:, :1].expand_as(level_tok))",
                ),
            ),
            ("tests/ddtree/test_tree.py",),
        ),
    ]
