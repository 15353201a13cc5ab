"""The driver side: boots vLLM with the plugin configured and drives it. No Qt here."""

from inspector.plugin.interventions import Intervention

__all__ = ["Intervention"]
