"""vllm and vllm-omni on the CPU: the platform plugin entry points (`plugin`, loaded by vllm's plugin discovery in
every process, so import-light), the OmniPlatform they select (`platform`) and its attention backend."""
