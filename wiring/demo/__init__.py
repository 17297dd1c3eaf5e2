"""The demo: a real mini GRPO loop on the embedded fleet (the README's main job)."""
