"""The trace file: Chrome trace-event JSON that Perfetto and ``chrome://tracing`` open.

A trace written by :func:`disco_core.trace` is one JSON object (version 1)::

    {
      "traceEvents": [...],
      "displayTimeUnit": "ms",
      "otherData": {
        "disco_trace": 1,
        "session": {"channel": "process", "num_workers": 4, "num_groups": 1},
        "duration_us": 1234.5,          # the traced window on the controller's clock
        "clock": {
          "offset_us": [0.0, 1.2, ...],  # worker clock minus controller clock, per worker
          "precision_us": [0.4, 9.1, ...],  # +- of each offset (half the best round trip)
          "method": "..."               # how the offsets were measured
        },
        "dropped": [0, 0, ...],         # oldest events lost to the ring buffer, per worker
        "controller_dropped": 0
      }
    }

Every time (``ts``, ``dur``) is in microseconds on the controller's clock, ``ts``
counted from the start of the trace; workers' times are moved onto it with their
measured offset. ``pid`` is always 1; ``tid`` 0 is the controller, ``tid`` ``w + 1``
worker ``w`` (``M`` events name the tracks). The events:

``cat: "command"`` (``ph: "X"``, a worker's track)
    One command a worker ran. ``name``: the global function's name for a
    ``call_packed`` (``"disco_demo.mlp_shard"``, ``"disco.allreduce"``), else the
    action (``"sync_worker"``, ``"get_global_func"``, ``"debug_get_from_remote"``,
    ``"debug_set_register"``; freeing registers, which rides with most commands, is not
    recorded). ``args``: ``worker``, ``action``, ``index`` (the command's place among
    the recorded commands of that worker's stream, from 0, in order), ``seq`` (the
    ``call_packed`` number, equal on every worker and on the controller's ``send``
    event; -1 for other actions), ``reg`` (the result register, 0 for none).
``cat: "copy"`` (``ph: "X"``, worker 0's track, and the controller's)
    A copy to or from worker 0. ``name``: ``"copy_to_worker_0"`` or
    ``"copy_from_worker_0"``; ``args``: ``worker``, ``bytes``, ``index``.
``cat: "module"`` (``ph: "X"``, a worker's track)
    A module load (``import_python_module``, ``load_module``); ``args`` as a command's.
``cat: "collective"`` (``ph: "X"``, a worker's track, inside its command)
    One collective or point-to-point operation of the CCL. ``name``: the operation
    (``allreduce``, ``allgather``, ``broadcast``, ``scatter``, ``gather``, ``barrier``,
    ``send``, ``recv``). ``args``: ``worker``, ``op`` (the same), ``reduce`` (allreduce's
    ``"sum"``...; else absent), ``dtype``, ``bytes`` (this member's ``src``; ``dst`` for ``broadcast`` and ``scatter``,
    whose ``src`` only the root has; the buffer for ``send``/``recv``),
    ``group`` (``"world"`` or ``"group"``), ``group_id``, ``seq`` (this worker's count of
    operations on that communicator, from 0; for ``send``/``recv``, of those to or from
    that peer), ``key`` (the same string on every member of one collective call:
    ``"world:12"``, ``"group1:3"``; a send and its recv share ``"p2p:<from>><to>:<k>"``,
    the k-th send from one worker to another with the k-th recv there from it),
    ``peer`` (``send``/``recv`` only), ``cmd_seq`` (the ``seq`` of the command it ran
    in, -1 if none), ``failed`` (``true`` when the operation raised: a peer died, the
    CCL was aborted, a wrong call; absent otherwise; its members need not have met).
``ph: "s"``, ``"t"``, ``"f"`` (``cat: "collective"``)
    Flow arrows that join the members of one collective call (same ``id``), in the
    order they started: ``s`` on the first to arrive, ``f`` on the last.
``cat: "send"`` (``ph: "X"``, ``dur`` 0, the controller's track)
    The controller sending one ``call_packed`` (when it started to). ``name``: the function's name;
    ``args``: ``seq``, ``site`` (``"file.py:123"``, the first caller outside Disco, for
    Disco's collective functions such as ``disco.allreduce``; ``""`` for the others,
    whose collectives a reader attributes to the function's name).
``cat: "sync"`` (``ph: "X"``, the controller's track)
    A synchronising call of the controller, from its start until it returned.
    ``name``: ``"sync_worker"``, ``"debug_get_from_remote"``, ...; ``args``: ``worker``.

Readers should ignore events and ``args`` keys they do not know.
"""

from __future__ import annotations

__all__ = ["FORMAT_VERSION", "CONTROLLER_TID", "PID", "worker_tid", "tid_worker"]

#: ``otherData.disco_trace`` of files this version writes.
FORMAT_VERSION = 1
#: The one process id of a trace.
PID = 1
#: The controller's track.
CONTROLLER_TID = 0


def worker_tid(worker_id: int) -> int:
    """The track (``tid``) of worker ``worker_id``."""
    return worker_id + 1


def tid_worker(tid: int) -> int:
    """The worker of track ``tid`` (-1 for the controller)."""
    return tid - 1
