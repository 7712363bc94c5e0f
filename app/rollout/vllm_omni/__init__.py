"""The vllm-omni rollout engine: the engine, the RL pipeline subclass and the worker extension. (The CPU platform
that runs it on machines without a GPU lives in app/platform/vllm_omni.)"""
