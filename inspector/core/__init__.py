"""The value vocabulary every layer shares: runs, hook points, interventions, positions, vectors, model
names and the session boundary. numpy and the standard library only, so that the app and a network
client never import torch."""

from .hooks import HookPoint
from .interventions import Intervention
from .protocol import (BootProgress, RequestStart, RequestStep, Sampling, SessionError, SessionOptions,
                       SessionProtocol, StepEvent)
from .run import HookRows, RequestCapture, Run, TopToken

__all__ = ["BootProgress", "HookPoint", "HookRows", "Intervention", "RequestCapture", "RequestStart",
           "RequestStep", "Run", "Sampling", "SessionError", "SessionOptions", "SessionProtocol", "StepEvent",
           "TopToken"]
