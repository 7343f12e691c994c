"""CPU test harness for megatron-core 0.15.3 GPTModels (gloo, no GPU needed).

See README.md in this directory for what is shimmed and why.
"""
