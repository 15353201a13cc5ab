"""The driver side: boots vLLM with the plugin configured and drives it. No Qt here."""
