"""The price table (TOML, see prices.toml): hourly prices, cost per million samples, cost of a job."""

import tomllib
from dataclasses import dataclass, field
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
    instances: dict[str, dict] = field(default_factory=dict)  # label -> {"hourly", "chips"}
    source: str | None = None
    date: str | None = None

    def hourly(self, hardware: str, device_name: str, cores: int | None, label: str | None = None) -> tuple[float | None, str]:
        """(price per hour, what it was based on) or (None, why there is none)."""
        instance = self.instances.get(label) if label else None
        if instance is not None:
            if hardware == "cpu":
                return instance["hourly"], f"instance {label!r} at {instance['hourly']} {self.currency}/hour"
            per_chip = instance["hourly"] / instance["chips"]
            return per_chip, f"instance {label!r}: {instance['hourly']} {self.currency}/hour / {instance['chips']} chips"
        if hardware == "cpu":
            if self.per_core_hour is None:
                return None, f"no [cpu] per_core_hour in {self.path}"
            if not cores:
                return None, "the run did not record its core count"
            return self.per_core_hour * cores, f"{cores} cores x {self.per_core_hour} {self.currency}/core-hour"
        key = self.match(device_name or "")
        if key is None:
            return None, f"no price for {device_name!r} in {self.path} [accelerator]"
        return self.accelerators[key], f"{key!r} at {self.accelerators[key]} {self.currency}/chip-hour"

    def match(self, device_name: str) -> str | None:
        """The longest accelerator name contained in the device name (case-insensitive)."""
        hits = [k for k in self.accelerators if k.lower() in device_name.lower()]
        return max(hits, key=len) if hits else None

    def provenance(self) -> str:
        """Where the prices come from, for the notes under every cost."""
        said = ", ".join(x for x in (self.source, self.date and f"as of {self.date}") if x)
        return f"{self.path}" + (f" ({said})" if said else "")


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
    instances = {}
    for label, entry in data.get("instance", {}).items():
        hourly = entry.get("hourly") if isinstance(entry, dict) else None
        chips = entry.get("chips", 1) if isinstance(entry, dict) else None
        if not isinstance(hourly, (int, float)) or hourly < 0 or not isinstance(chips, int) or chips < 1:
            raise PriceTableError(
                f"the price table {path}: [instance] {label!r} must be {{ hourly = <number >= 0>, chips = <integer >= 1> }}")
        instances[label] = {"hourly": float(hourly), "chips": chips}
    return PriceTable(str(path), data.get("currency", "USD"), cpu.get("per_core_hour"), dict(accelerators), instances,
                      data.get("source"), str(data["date"]) if "date" in data else None)


def cost_per_million_samples(hourly_price: float, step_seconds: float, batch_size: int) -> float:
    return hourly_price / 3600 * step_seconds / batch_size * 1e6


@dataclass
class Budget:
    """The whole job: so many samples or tokens to process."""

    amount: float
    unit: str  # "samples" or "tokens"

    def describe(self) -> str:
        return f"{self.amount:.3g} {self.unit}"


def job_figures(row: dict, budget: Budget | None) -> dict:
    """Time and cost to process the budget at the row's measured throughput (None where unknown)."""
    figures = {"time_to_train_s": None, "cost_to_train": None}
    if budget is None or row.get("status") != "ok":
        return figures
    rate = row.get("tokens_per_s") if budget.unit == "tokens" else row.get("samples_per_s")
    if not rate:
        return figures
    figures["time_to_train_s"] = budget.amount / rate
    if row.get("price_per_hour") is not None:
        figures["cost_to_train"] = row["price_per_hour"] * figures["time_to_train_s"] / 3600
    return figures
