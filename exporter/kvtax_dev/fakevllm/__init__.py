"""The one fake vLLM: every stand-in for vLLM's server in this checkout, over one event builder.

The builder is pure: :mod:`.events` makes the bytes of vLLM 0.32's completions and chat answers
(streams and whole), :mod:`.apis` those of its named-event APIs, generate and the audio
streams; what differs between the stand-ins is a :class:`~.events.Style`. Two transports send
them:

- aiohttp: :mod:`.aio` (:class:`~.aio.FakeVllm`, in process, with knobs for faults, for the unit
  tests), :mod:`.fast` (the relay bench's upstream, every chunk encoded once) and
  :mod:`.faulty` (the soak's upstream, faults asked for by each request);
- raw asyncio, every byte the test's: :mod:`.raw` (what reached the upstream, the scripts'
  framing), :mod:`.vllmlike` (the vLLM-shaped script), :mod:`.upstream`
  (:class:`~.upstream.RawUpstream`, parsing with h11), :mod:`.client` (raw-socket clients) and
  :mod:`.front` (:class:`~.front.Front`: a proxy in front of a RawUpstream).

Nothing outside this package writes a ``[DONE]`` event of its own
(``tests/unit/test_one_fakevllm.py`` fails if one does). Import the modules themselves: this
one imports none of them, so a bench's upstream loads neither h11 nor kvtax's proxy.
"""

__all__: list[str] = []
