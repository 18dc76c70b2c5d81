"""Pool A: vLLM with routed experts served by remote expert workers."""
