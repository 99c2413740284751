"""``chaos.daemon``: the long-lived control-plane daemon (one per device).

It never imports torch. Entry point: ``chaos-daemon`` (:mod:`chaos.daemon.cli`).
"""
