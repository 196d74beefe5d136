"""Measuring the system: the UA-GEC benchmark of every decoding mode (`benchmark`), the load test
against a running gateway (`loadtest`), the text quality of a training run's verifier
(`run_quality`), the GEC scores and verifier perplexity they report (`gec_metrics`, `perplexity`),
and what every benchmark shares: the machine's stamp, services started as a user starts them, and
the BENCHMARKS.md section writer (`bench_report`). `specdec bench`, `specdec loadtest` and `specdec
evaluate` parse their flags and print; the scripts under bench/ build on the same modules."""
