"""``examples/pretrain_gpt_tst.py`` (Megatron-LM's ``pretrain()`` with TST) plus one router
metric Megatron-LM 0.19 does not log: ``load_imbalance``, max over mean tokens per expert.

Megatron-LM's MoE metrics tracker (``megatron.core.transformer.moe.moe_logging``) already
writes ``load_balancing_loss`` (the aux loss over its coefficient, the mean over MoE layers)
to TensorBoard at every iteration, and ``moe/load_balancing_loss_layer_<i>`` per layer with
``--moe-per-layer-logging``. This wrapper records, in every training forward of every
``TopKRouter`` (not in evaluation: grad disabled), the tokens routed to each expert summed
over the router's TP x DP x CP group (every token of the micro-batch on every data-parallel
rank), then ``max / mean`` of those counts, into the same tracker. The tracker's
``report()`` is told to report ``load_imbalance`` too, so Megatron-LM's own ``training_log``
writes ``load_imbalance`` (the mean over layers) and ``moe/load_imbalance_layer_<i>`` with the
aux loss, averaged over the micro-batches of the iteration. 1.0 is perfect balance; with
top-k routing over E experts the worst is E / k (4.0 for 8 experts top-2: two experts get
every token).

Nothing else changes: the hook reads the routing map the router returns and adds one
all-reduce of ``E`` counts per layer and micro-batch. Run it as the launcher::

    torchrun --nproc_per_node 2 benchmarks/moe_launcher.py <the launcher's flags>
"""

from __future__ import annotations

import os
import sys

METRIC = "load_imbalance"


def install() -> None:
    """Patch ``TopKRouter.routing`` (record the metric) and ``MoEMetricsTracker.report``
    (report it with the names ``training_log`` asks for)."""
    import torch
    from megatron.core.transformer.moe import router as moe_router
    from megatron.core.transformer.moe.moe_logging import (
        MoEMetricsTracker,
        get_moe_metrics_tracker,
    )

    routing = moe_router.TopKRouter.routing
    if getattr(routing, "_records_load_imbalance", False):
        return

    def routing_with_imbalance(self, logits, *args, **kwargs):
        probs, routing_map = routing(self, logits, *args, **kwargs)
        if torch.is_grad_enabled() and self.training:
            with torch.no_grad():
                counts = routing_map.sum(dim=0).float()
                group = getattr(self, "tp_dp_cp_group", None)
                if group is not None and torch.distributed.is_initialized():
                    torch.distributed.all_reduce(counts, group=group)
                value = counts.max() / counts.mean().clamp(min=1e-9)
            layers = self.config.num_layers + (self.config.mtp_num_layers or 0)
            # the same value on every rank: the DP average leaves it as it is
            get_moe_metrics_tracker().record(METRIC, value, self.layer_number, layers)
        return probs, routing_map

    routing_with_imbalance._records_load_imbalance = True
    moe_router.TopKRouter.routing = routing_with_imbalance

    report = MoEMetricsTracker.report

    def report_with_imbalance(self, *args, track_names=None, **kwargs):
        if track_names is not None:
            names = [track_names] if isinstance(track_names, str) else list(track_names)
            if METRIC not in names:
                names.append(METRIC)
            track_names = names
        return report(self, *args, track_names=track_names, **kwargs)

    MoEMetricsTracker.report = report_with_imbalance


def main() -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)
    install()
    from tst_megatron.training.cli import main as launch

    launch()


if __name__ == "__main__":  # dist_checkpointing spawns processes: keep the guard
    main()
