"""The relay's cost and behaviour: kvtax beside nginx and a bare pass-through (relay), instructions
per event (instructions), the real engine behind it (engine_relay), hostile input (frontdoor)."""
