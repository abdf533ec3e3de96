"""The price table (TOML, see prices.toml) and cost per million samples."""

import tomllib
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PRICES = Path(__file__).with_name("prices.toml")


class PriceTableError(Exception):
    pass


@dataclass
class PriceTable:
    path: str
    currency: str
    per_core_hour: float | None
    accelerators: dict[str, float]

    def hourly(self, hardware: str, device_name: str, cores: int | None) -> tuple[float | None, str]:
        """(price per hour, what it was based on) or (None, why there is none)."""
        if hardware == "cpu":
            if self.per_core_hour is None:
                return None, f"no [cpu] per_core_hour in {self.path}"
            return self.per_core_hour * cores, f"{cores} cores x {self.per_core_hour} {self.currency}/core-hour"
        key = self.match(device_name)
        if key is None:
            return None, f"no price for {device_name!r} in {self.path} [accelerator]"
        return self.accelerators[key], f"{key!r} at {self.accelerators[key]} {self.currency}/chip-hour"

    def match(self, device_name: str) -> str | None:
        """The longest accelerator name contained in the device name (case-insensitive)."""
        hits = [k for k in self.accelerators if k.lower() in device_name.lower()]
        return max(hits, key=len) if hits else None


def load(path: str | Path | None = None) -> PriceTable:
    path = Path(path) if path else DEFAULT_PRICES
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise PriceTableError(f"cannot read the price table {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise PriceTableError(f"the price table {path} is not valid TOML: {e}") from None
    cpu = data.get("cpu", {})
    accelerators = data.get("accelerator", {})
    numbers = [cpu.get("per_core_hour", 0), *accelerators.values()]
    if not all(isinstance(v, (int, float)) and v >= 0 for v in numbers):
        raise PriceTableError(f"the price table {path}: every price must be a number >= 0")
    return PriceTable(str(path), data.get("currency", "USD"), cpu.get("per_core_hour"), dict(accelerators))


def cost_per_million_samples(hourly_price: float, step_seconds: float, batch_size: int) -> float:
    return hourly_price / 3600 * step_seconds / batch_size * 1e6
