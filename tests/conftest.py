"""Session-wide settings for the test run.

The tiny test models are far too small for intra-op parallelism: on a shared 2-core machine
torch's thread pool makes them several times slower (threads spin against each other and
against other processes). One thread per process, unless OMP_NUM_THREADS says otherwise; the
variable is also inherited by the `specdec` processes the tests start.

The gateways those processes start take an ephemeral loopback port for their HTTP endpoints
(SPECDEC__GATEWAY__HTTP_ADDRESS), so parallel test workers never compete for the default one;
`ServiceStack` does the same for the stacks the tests start in-process.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS") or "1"
os.environ.setdefault("SPECDEC__GATEWAY__HTTP_ADDRESS", "127.0.0.1:0")

import torch  # after OMP_NUM_THREADS, which torch reads on import

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
