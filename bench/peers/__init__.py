"""aiomm against its peers (smg's Rust router, vLLM's render server) on one machine, one run.

Modules: ``bench`` (the command: systems, load, table), ``exactness`` (each system's pixels
against the HF processor's) and ``smg_worker`` (the stand-in vLLM gRPC engine behind smg, run in
smg's own interpreter). Run ``python bench/peers --help`` from a checkout.
"""
