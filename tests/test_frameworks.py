"""The training frameworks people use, unchanged but for the device, against the CPU: Lightning
(Trainer and Fabric, one device and DDP), PEFT LoRA, HF Trainer, and a PyTorch-examples style
script with a multi-worker pinned DataLoader."""

import json
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

import torchpjrt  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script(code, *args, env=None, timeout=600):
    """Run `code` as a script file in a fresh interpreter (launchers such as Lightning's start it
    again per rank); returns the JSON of each stdout line starting with RESULT, then of each file
    the script wrote into $RESULTS_DIR (ranks sharing one stdout pipe can interleave their lines)."""
    with tempfile.TemporaryDirectory() as directory:
        results = os.path.join(directory, "results")
        os.mkdir(results)
        full_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "RESULTS_DIR": results, **(env or {})}
        path = os.path.join(directory, "program.py")
        with open(path, "w") as f:
            f.write(textwrap.dedent(code))
        r = subprocess.run([sys.executable, path, *args], capture_output=True, text=True,
                           timeout=timeout, env=full_env, cwd=ROOT)
        assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
        found = [json.loads(line[len("RESULT "):]) for line in r.stdout.splitlines() if line.startswith("RESULT ")]
        for name in sorted(os.listdir(results)):
            with open(os.path.join(results, name)) as f:
                found.append(json.load(f))
    return found


# ---- Lightning -------------------------------------------------------------------------------

LIGHTNING = """
import json, os, sys
import torch, lightning as L
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        self.devices_seen = set()
        self.losses = []
    def training_step(self, batch, i):
        x, y = batch
        self.devices_seen.add(str(x.device))
        loss = F.cross_entropy(self.net(x), y)
        self.losses.append(loss.item())
        return loss
    def validation_step(self, batch, i):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))
    def predict_step(self, batch, i):
        return self.net(batch[0]).argmax(-1)
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
x = torch.randn(64, 8, generator=g)
y = (x[:, 0] > 0).long()
loader = DataLoader(TensorDataset(x, y), batch_size=16)
model = Classifier()
trainer = L.Trainer(accelerator=sys.argv[1], devices=int(sys.argv[2]), max_epochs=2, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model, loader, loader)
result = {"rank": trainer.global_rank, "seen": sorted(model.devices_seen), "losses": model.losses,
          "weight": model.net[0].weight.detach().cpu().tolist(), "strategy": type(trainer.strategy).__name__}
if int(sys.argv[2]) == 1:
    result["val"] = trainer.validate(model, loader, verbose=False)[0]["val_loss"]
    result["predictions"] = torch.cat([p.cpu() for p in trainer.predict(model, loader)]).tolist()
with open(os.path.join(os.environ["RESULTS_DIR"], f"rank{trainer.global_rank}.json"), "w") as f:
    json.dump(result, f)  # one file per rank: the ranks share one stdout
"""


@pytest.mark.slow  # fresh processes
def test_lightning_trainer_fits_validates_predicts_like_cpu():
    pytest.importorskip("lightning")
    (cpu,), (pjrt,) = _script(LIGHTNING, "cpu", "1"), _script(LIGHTNING, "pjrt", "1")
    assert pjrt["seen"] == ["pjrt:0"] and pjrt["strategy"] == "SingleDeviceStrategy"
    torch.testing.assert_close(torch.tensor(pjrt["losses"]), torch.tensor(cpu["losses"]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(pjrt["weight"]), torch.tensor(cpu["weight"]), rtol=1e-5, atol=1e-6)
    assert abs(pjrt["val"] - cpu["val"]) < 1e-5
    assert pjrt["predictions"] == cpu["predictions"]


@pytest.mark.slow  # two ranks, started by Lightning's own launcher
@pytest.mark.timeout(400)
def test_lightning_ddp_on_two_processes_matches_cpu():
    pytest.importorskip("lightning")
    env = {"TORCHPJRT_PLATFORM": "cpu"}
    cpu = sorted(_script(LIGHTNING, "cpu", "2", env=env), key=lambda r: r["rank"])
    pjrt = sorted(_script(LIGHTNING, "pjrt", "2", env=env), key=lambda r: r["rank"])
    assert [r["rank"] for r in pjrt] == [0, 1]
    for got, want in zip(pjrt, cpu):
        assert got["seen"] == ["pjrt:0"] and got["strategy"] == "PjrtDDPStrategy"
        torch.testing.assert_close(torch.tensor(got["weight"]), torch.tensor(want["weight"]), rtol=1e-5, atol=1e-6)
    assert pjrt[0]["weight"] == pjrt[1]["weight"]  # DDP kept the replicas equal


def test_lightning_registry_and_devices():
    L = pytest.importorskip("lightning")
    from lightning.pytorch.accelerators import AcceleratorRegistry

    assert "pjrt" in AcceleratorRegistry.available_accelerators()
    accelerator = AcceleratorRegistry.get("pjrt")
    assert accelerator.is_available() and accelerator.auto_device_count() == torch.pjrt.device_count()
    assert accelerator.get_parallel_devices(2) == [torch.device("pjrt", 0)] * 2
    assert accelerator.parse_devices("auto") == torch.pjrt.device_count()
    with pytest.raises(ValueError, match="devices=0"):
        accelerator.parse_devices(0)
    with pytest.raises(ValueError, match="got device cpu"):
        accelerator.setup_device(torch.device("cpu"))
    trainer = L.Trainer(accelerator="pjrt", devices=1, logger=False, enable_progress_bar=False)
    assert trainer.strategy.root_device == torch.device("pjrt", 0)


def test_fabric_trains_on_pjrt():
    L = pytest.importorskip("lightning")
    results = {}
    for accelerator in ("cpu", "pjrt"):
        torch.manual_seed(0)
        fabric = L.Fabric(accelerator=accelerator, devices=1)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = fabric.setup(model, opt)
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1)).to(fabric.device)
        for _ in range(5):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            fabric.backward(loss)
            opt.step()
        results[accelerator] = (str(fabric.device), loss.item())
    assert results["pjrt"][0] == "pjrt:0"
    assert abs(results["pjrt"][1] - results["cpu"][1]) < 1e-6


# ---- PEFT --------------------------------------------------------------------------------------


def _lora_run(device, tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(config),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    model.to(device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1)).to(device)
    losses = []
    for _ in range(10):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    adapter = tmp_path / f"adapter_{device}"
    model.save_pretrained(adapter)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.cpu()
    reloaded = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM(config), adapter).to(device)
    merged = model.merge_and_unload()
    with torch.no_grad():
        reloaded_logits = reloaded(input_ids=ids).logits.cpu()
        merged_logits = merged(input_ids=ids).logits.cpu()
    return losses, logits, reloaded_logits, merged_logits, adapter


@pytest.mark.slow  # two LLaMA fine-tunes
def test_peft_lora_trains_saves_loads_and_merges_like_cpu(tmp_path):
    cpu = _lora_run("cpu", tmp_path)
    pjrt = _lora_run("pjrt", tmp_path)
    torch.testing.assert_close(torch.tensor(pjrt[0]), torch.tensor(cpu[0]), rtol=1e-4, atol=1e-5)
    for got, want in zip(pjrt[1:4], cpu[1:4]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # the adapter saved from pjrt equals the one saved from the CPU, and loads onto either
    import safetensors.torch

    a = safetensors.torch.load_file(pjrt[4] / "adapter_model.safetensors")
    b = safetensors.torch.load_file(cpu[4] / "adapter_model.safetensors")
    assert set(a) == set(b) and len(a) == 8  # q and v, A and B, 2 layers
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)


# ---- HF Trainer ---------------------------------------------------------------------------------

TRAINER = """
import json, os, sys, tempfile
import torch, transformers

def run(kind, dropout, checkpointing):
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                         resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=64, max_position_embeddings=32, num_labels=3,
                                         hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
        model = transformers.BertForSequenceClassification(config)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (48, 16), generator=g)
    labels = ids if kind == "gpt2" else torch.randint(0, 3, (48,), generator=g)
    rows = [{"input_ids": i, "labels": l} for i, l in zip(ids, labels)]
    out = tempfile.mkdtemp()
    # TrainingArguments' defaults (AdamW fused, linear schedule, dropout on), with gradient checkpointing
    args = transformers.TrainingArguments(output_dir=out, max_steps=20, per_device_train_batch_size=4,
                                          gradient_checkpointing=checkpointing, logging_steps=1, report_to=[],
                                          save_strategy="no", seed=0, data_seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows[:40], eval_dataset=rows[40:])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    evaluation = trainer.evaluate()["eval_loss"]
    trainer.save_model(os.path.join(out, "final"))
    reloaded = type(model).from_pretrained(os.path.join(out, "final"))
    same = all(torch.equal(a.detach().cpu(), b) for a, b in zip(model.state_dict().values(), reloaded.state_dict().values()))
    print("RESULT " + json.dumps({"device": str(args.device), "model_device": str(next(model.parameters()).device),
                                  "losses": losses, "eval": evaluation, "reloaded_equal": same}))

# each run a "dropout:checkpointing" pair; runs after the first share the process (the Trainer seeds
# every run itself)
for pair in sys.argv[2:]:
    dropout, checkpointing = pair.split(":")
    run(sys.argv[1], float(dropout), checkpointing == "1")
"""


@pytest.mark.slow  # fresh processes, 20 steps of two models, four runs each in three processes
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_hf_trainer_defaults_train_like_cpu(kind):
    """TrainingArguments' defaults with gradient checkpointing: without dropout the losses are the
    CPU's; with dropout (pjrt draws other random numbers than the CPU by design) checkpointing
    replays the forward's masks, so the run equals the same run without checkpointing."""
    pytest.importorskip("transformers")
    (cpu,) = _script(TRAINER, kind, "0:1", env={"ACCELERATE_USE_CPU": "true"})
    (pjrt,) = _script(TRAINER, kind, "0:1", env={"ACCELERATE_TORCH_DEVICE": "pjrt"})
    assert cpu["device"] == "cpu" and pjrt["device"] == "pjrt" and pjrt["model_device"] == "pjrt:0"
    assert len(pjrt["losses"]) == 20
    torch.testing.assert_close(torch.tensor(pjrt["losses"]), torch.tensor(cpu["losses"]), rtol=1e-4, atol=1e-5)
    assert abs(pjrt["eval"] - cpu["eval"]) <= 1e-4 * abs(cpu["eval"])
    assert pjrt["reloaded_equal"] and cpu["reloaded_equal"]
    # with dropout, checkpointed then plain in one process: each run seeds itself as Trainer does
    checkpointed, plain = _script(TRAINER, kind, "0.1:1", "0.1:0", env={"ACCELERATE_TORCH_DEVICE": "pjrt"})
    assert checkpointed["losses"] != pjrt["losses"]  # dropout is on
    torch.testing.assert_close(torch.tensor(checkpointed["losses"]), torch.tensor(plain["losses"]), rtol=1e-5, atol=1e-6)


# ---- a PyTorch-examples style script --------------------------------------------------------------

EXAMPLE = """
import json, sys
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

class Net(nn.Module):  # the MNIST example's network, on 1x16x16 inputs
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.fc1 = nn.Linear(16 * 6 * 6, 32)
        self.fc2 = nn.Linear(32, 10)
    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = torch.flatten(self.dropout1(x), 1)
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)

if __name__ == "__main__":
    device = torch.device(sys.argv[1])
    torch.manual_seed(1)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(128, 1, 16, 16, generator=g), torch.randint(0, 10, (128,), generator=g))
    loader = DataLoader(data, batch_size=32, shuffle=True, num_workers=2, pin_memory=True,
                        generator=torch.Generator().manual_seed(2))
    model = Net().to(device)
    model.eval()  # dropout off: CPU and pjrt draw different random numbers
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    losses = []
    for epoch in range(2):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad()
            loss = F.nll_loss(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        scheduler.step()
    with torch.no_grad():
        correct = sum((model(x.to(device)).argmax(1) == y.to(device)).sum().item() for x, y in loader)
    print("RESULT " + json.dumps({"losses": losses, "correct": correct}))
"""


@pytest.mark.slow  # fresh processes with DataLoader workers
@pytest.mark.timeout(600)
def test_examples_style_script_with_pinned_multiworker_loader():
    runs = {device: _script(EXAMPLE, device)[-1] for device in ("cpu", "pjrt")}
    torch.testing.assert_close(torch.tensor(runs["pjrt"]["losses"]), torch.tensor(runs["cpu"]["losses"]),
                               rtol=1e-4, atol=1e-5)
    assert runs["pjrt"]["correct"] == runs["cpu"]["correct"]
