"""What one collective costs on a link, and which link each parallel group's collectives cross.

Ring algorithms (NCCL's, and gloo's for large messages): an all-reduce of B bytes over n ranks
moves 2(n-1)/n * B through each rank's link in 2(n-1) steps; an all-gather or a reduce-scatter
whose whole is B moves (n-1)/n * B in n-1 steps; an all-to-all in which each rank holds B sends
(n-1)/n * B. Each step pays the link's latency (the scaling book's collectives chapter; NCCL's
performance notes, "bus bandwidth"). Each call also pays the link's ``sync`` once: where the host
runs the collective (gloo), the time it waits for the later rank and for its own wake-up.

Placement follows the rank grid (DESIGN.md: [dp, pp, cp, tp], TP innermost): a group of ``size``
ranks at ``stride`` spans stride * size consecutive ranks and crosses nodes when that exceeds a
node's GPUs; a ring that crosses nodes runs at the network's per-GPU bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.estimate.cluster import Cluster, Link


def _call(seconds: float, link: Link) -> float:
    """A collective's ring time, and the host's wait that each call adds."""
    return seconds + link.sync if seconds else 0.0


def all_reduce(nbytes: float, n: int, link: Link) -> float:
    ring = 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency
    return 0.0 if n == 1 else _call(ring, link)


def _ring_half(whole_bytes: float, n: int, link: Link) -> float:
    return 0.0 if n == 1 else (n - 1) / n * whole_bytes / link.bandwidth + (n - 1) * link.latency


def all_gather(whole_bytes: float, n: int, link: Link) -> float:
    """All-gather of a tensor of ``whole_bytes`` over ``n`` ranks (times the link's measured
    ``gather`` factor, where a calibration found the library slower than the ring)."""
    return _call(link.gather * _ring_half(whole_bytes, n, link), link)


def reduce_scatter(whole_bytes: float, n: int, link: Link) -> float:
    """Reduce-scatter of a tensor of ``whole_bytes``: the all-gather's traffic, run the other
    way (times the link's ``scatter`` factor)."""
    return _call(link.scatter * _ring_half(whole_bytes, n, link), link)


def all_to_all(nbytes: float, n: int, link: Link) -> float:
    """Each rank keeps 1/n of the ``nbytes`` it holds and sends the rest."""
    return _call(_ring_half(nbytes, n, link), link)


def send(nbytes: float, link: Link) -> float:
    return nbytes / link.bandwidth + link.latency + link.sync


@dataclass(frozen=True)
class Links:
    """The link each group's collectives run on, for one layout on one cluster."""

    tp: Link
    cp: Link
    pp: Link
    dp: Link  # the DP x CP replicas that reduce the dense gradients
    ep: Link
    crosses_nodes: dict[str, bool]  # group -> whether it crosses nodes (for the report)

    @classmethod
    def of(cls, cluster: Cluster, tp: int, cp: int, pp: int, dp: int, ep: int) -> Links:
        node = cluster.gpus_per_node
        span = {
            "tp": tp,
            "cp": tp * cp,
            "pp": tp * cp * pp,
            "dp": tp * cp * pp * dp,
            # EP groups take the CP ranks first, then DP replicas (at stride tp * cp * pp)
            "ep": tp * ep if ep <= cp else tp * cp * pp * (ep // cp),
        }
        sizes = {"tp": tp, "cp": cp, "pp": pp, "dp": dp * cp, "ep": ep}
        crosses = {g: sizes[g] > 1 and span[g] > node for g in span}
        return cls(**{g: cluster.link(crosses[g]) for g in span}, crosses_nodes=crosses)
