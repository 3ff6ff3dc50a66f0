"""Decoding audio clips (``.wav``, standard library ``wave``) at the feature extractor's sampling rate.

PCM ``.wav`` files of 8, 16, 24 or 32 bits (any channel count: channels are averaged to mono) are
read as floats in [-1, 1]; a clip at another rate is resampled to the feature extractor's rate by
linear interpolation (``numpy.interp``). Other formats are a one-line ``ValueError`` naming the fix.
"""

from __future__ import annotations

import wave

import numpy as np


def decode_audio(path: str, sampling_rate: int, source: str) -> np.ndarray:
    """The mono float32 waveform of the ``.wav`` file ``path`` at ``sampling_rate`` Hz.

    Raises:
        ValueError: the file cannot be read as PCM ``.wav`` (naming ``source`` and the fix).
    """
    try:
        with wave.open(path, "rb") as clip:
            channels, width, rate = clip.getnchannels(), clip.getsampwidth(), clip.getframerate()
            raw = clip.readframes(clip.getnframes())
    except (OSError, EOFError, wave.Error) as err:
        raise ValueError(f"{source}: audio {path} cannot be read as a PCM .wav ({err}); convert it to .wav") from err
    if width == 1:
        samples = (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 3:
        bytes_ = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3)
        ints = bytes_[:, 0].astype(np.int32) | bytes_[:, 1].astype(np.int32) << 8 | bytes_[:, 2].astype(np.int32) << 16
        samples = (np.where(ints >= 1 << 23, ints - (1 << 24), ints) / float(1 << 23)).astype(np.float32)
    elif width in (2, 4):
        dtype = np.int16 if width == 2 else np.int32
        samples = np.frombuffer(raw, dtype=dtype).astype(np.float32) / float(np.iinfo(dtype).max + 1)
    else:
        raise ValueError(f"{source}: audio {path} has {8 * width}-bit samples; convert it to 16-bit PCM .wav")
    samples = samples.reshape(-1, channels).mean(axis=1)
    if samples.size == 0:
        raise ValueError(f"{source}: audio {path} holds no samples; remove it or give a non-empty clip")
    if rate != sampling_rate:
        count = max(1, round(samples.size * sampling_rate / rate))
        samples = np.interp(np.arange(count) * rate / sampling_rate, np.arange(samples.size), samples)
    return samples.astype(np.float32)


def write_wav(path: str, samples: np.ndarray, sampling_rate: int) -> None:
    """Write a mono float waveform in [-1, 1] as a 16-bit PCM ``.wav`` file."""
    ints = np.clip(np.round(np.asarray(samples, dtype=np.float64) * 32767.0), -32768, 32767).astype("<i2")
    with wave.open(path, "wb") as clip:
        clip.setnchannels(1)
        clip.setsampwidth(2)
        clip.setframerate(sampling_rate)
        clip.writeframes(ints.tobytes())
