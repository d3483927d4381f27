"""Offline stand-ins for real models: a fake OpenAI/Anthropic-compatible server that serves the
scripted models (or any responder) on 127.0.0.1."""
