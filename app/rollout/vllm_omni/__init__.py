"""The vllm-omni rollout engine: RL pipeline subclass, worker extension, CPU platform. Import-light on purpose
(`cpu_plugin` is loaded by vllm's plugin discovery in every process)."""
