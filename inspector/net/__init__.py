"""Networking shared by ``inspector serve`` and its clients: the wire format, key files, and the socket
thread both sides run. ZeroMQ, MessagePack and numpy only: clients never import torch."""
