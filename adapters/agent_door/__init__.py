"""The agent door: an OpenAI server in front of the fleet's Dynamo frontend for agentic
clients, token-exact across the turns of a trajectory (``door.py``)."""
