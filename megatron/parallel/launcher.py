"""The launcher's environment (torchrun, SLURM, or none) as the rank, world size and rendezvous."""

from __future__ import annotations

import os
import re
import subprocess


def launcher_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """Rank/world/master settings from torchrun, from SLURM srun-per-task, or a world of one.

    torchrun sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*. Under ``srun`` with one task per GPU only
    SLURM_* is set; the master is then the first host of the job's node list.
    """
    env = dict(os.environ if env is None else env)
    if "RANK" in env and "WORLD_SIZE" in env:
        out = {k: env[k] for k in ("RANK", "WORLD_SIZE")}
        out["LOCAL_RANK"] = env.get("LOCAL_RANK", "0")
        out["MASTER_ADDR"] = env.get("MASTER_ADDR", "127.0.0.1")
        out["MASTER_PORT"] = env.get("MASTER_PORT", "29500")
        return out
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        master = env.get("MASTER_ADDR") or first_slurm_host(env.get("SLURM_JOB_NODELIST", ""))
        return {
            "RANK": env["SLURM_PROCID"],
            "WORLD_SIZE": env["SLURM_NTASKS"],
            "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
            "MASTER_ADDR": master or "127.0.0.1",
            "MASTER_PORT": env.get("MASTER_PORT", "29500"),
        }
    return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}


def attempt_prefix(name: str) -> str:
    """A store prefix of ``name`` for this attempt: torchrun's agent hosts the store and outlives
    a restart of its workers (``--max-restarts``), so what a worker publishes there is kept per
    attempt, or the next attempt's workers would read what the dead ones left."""
    return f"megatron/{name}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list, via ``scontrol`` when present, else parsed here.

    Handles the compressed forms ``node[01-04,07]`` and ``a1,b2``; ``scontrol`` is preferred
    because it knows every form the scheduler emits.
    """
    if not nodelist:
        return ""
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
        ).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.CalledProcessError):
        pass
    # The first expression (commas inside brackets do not end it), each bracket replaced by its
    # first id: keeps suffixes and later brackets (node[01-02]-ib -> node01-ib,
    # rack[1-2]-gpu[08,10] -> rack1-gpu08).
    first = re.match(r"(?:[^,\[]|\[[^\]]*\])+", nodelist).group(0)
    return re.sub(r"\[([^\]]*)\]", lambda ids: re.split(r"[-,]", ids.group(1))[0], first)
