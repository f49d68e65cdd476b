"""The OpenAI-compatible gateway of the generation ranks: agents written against an OpenAI
endpoint drive this rank's rollout engine, and the exact tokens they were served are trained."""
