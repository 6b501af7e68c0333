"""The tier layer: the host (CPU DRAM) tier over the Rust index and pinned pool, the disk tier's
opening, the key and block-id checks every entry point shares, the block event stream, and the
host region vLLM's scheduler and workers share. Modules are imported on use: the host tier needs
numpy, which the index alone does not."""
