//! Performance profiles: how long one engine step takes, from a roofline of the model on its GPUs.
//!
//! A step runs every scheduled request's new tokens in one forward pass. Its time is the larger
//! of its compute time (matrix FLOPs for every new token plus causal attention over the context)
//! and its memory time (the weights once, plus every scheduled request's KV cache), each at an
//! efficiency factor of the GPU's peak, plus a fixed per-step overhead (scheduling, sampling,
//! kernel launches). Prefill steps are compute-bound and grow with uncached tokens and context;
//! decode steps are memory-bound and grow with batch size and KV read.
//!
//! The named profiles and the published measurements they are calibrated against are listed in
//! the crate README ("Step-loop engines").

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A transformer's shape, as far as step time depends on it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// Parameters (weights read once per step, 2 FLOPs per parameter per token).
    pub params: f64,
    /// Decoder layers.
    pub layers: u32,
    /// Hidden size (query heads x head dim): attention FLOPs per token pair and layer are `4 x hidden`.
    pub hidden: u32,
    /// Key/value heads (grouped-query attention).
    pub kv_heads: u32,
    /// Dimension of one head.
    pub head_dim: u32,
    /// Bytes per weight (2 for BF16, 1 for FP8).
    pub bytes_per_param: f64,
    /// Bytes per KV-cache element.
    pub kv_bytes: f64,
}

impl ModelSpec {
    /// KV-cache bytes of one token (keys and values of every layer).
    pub fn kv_bytes_per_token(&self) -> f64 {
        2.0 * f64::from(self.layers)
            * f64::from(self.kv_heads)
            * f64::from(self.head_dim)
            * self.kv_bytes
    }
}

/// The GPUs one engine runs on (tensor parallel across `count`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GpuSpec {
    /// GPUs of the engine (tensor-parallel degree).
    pub count: u32,
    /// Dense peak FLOP/s of one GPU at the weights' precision.
    pub peak_flops: f64,
    /// Memory bandwidth of one GPU, bytes/s.
    pub hbm_bandwidth: f64,
    /// Share of the peak FLOP/s a forward pass reaches (model FLOPs utilisation).
    pub compute_efficiency: f64,
    /// Share of the memory bandwidth a decode step reaches.
    pub memory_efficiency: f64,
    /// Fixed time per step, seconds (scheduling, sampling, launches, tensor-parallel sync).
    pub step_overhead: f64,
}

/// One request's part of a step: tokens it computes now and tokens already in its KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Work {
    /// Tokens computed in this step (a prefill chunk, or 1 for a decode).
    pub new_tokens: u32,
    /// Tokens of the request already in KV before this step (cached, earlier chunks, generated).
    pub context: u32,
}

/// A named model-on-GPU performance profile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    /// The name `--profile` takes.
    pub name: String,
    /// The model.
    pub model: ModelSpec,
    /// Its GPUs.
    pub gpu: GpuSpec,
    /// Context window served (`--max-model-len` default).
    pub max_model_len: u32,
    /// KV-cache blocks of 16 tokens the GPUs hold after the weights (`--kv-cache-blocks` default).
    pub kv_cache_blocks: usize,
}

/// Llama 3.1 8B's shape (BF16).
const LLAMA_31_8B: ModelSpec = ModelSpec {
    params: 8.03e9,
    layers: 32,
    hidden: 4096,
    kv_heads: 8,
    head_dim: 128,
    bytes_per_param: 2.0,
    kv_bytes: 2.0,
};

/// Llama 3.1 70B's shape (BF16).
const LLAMA_31_70B: ModelSpec = ModelSpec {
    params: 70.6e9,
    layers: 80,
    hidden: 8192,
    kv_heads: 8,
    head_dim: 128,
    bytes_per_param: 2.0,
    kv_bytes: 2.0,
};

/// Efficiency factors shared by the profiles (see the README for where they come from).
const COMPUTE_EFFICIENCY: f64 = 0.55;
const MEMORY_EFFICIENCY: f64 = 0.77;

/// A100s reach a larger share of their (lower) peak in prefill than H100s do.
const A100_COMPUTE_EFFICIENCY: f64 = 0.65;

fn a100_40gb(count: u32) -> GpuSpec {
    GpuSpec {
        count,
        peak_flops: 312e12,
        hbm_bandwidth: 1.555e12,
        compute_efficiency: A100_COMPUTE_EFFICIENCY,
        memory_efficiency: MEMORY_EFFICIENCY,
        step_overhead: 0.0003,
    }
}

fn h100_sxm(count: u32) -> GpuSpec {
    GpuSpec {
        count,
        peak_flops: 989e12,
        hbm_bandwidth: 3.35e12,
        compute_efficiency: COMPUTE_EFFICIENCY,
        memory_efficiency: MEMORY_EFFICIENCY,
        // Tensor parallelism adds two all-reduces per layer to every step, latency-bound at
        // decode batch sizes, so a fixed cost per step; fitted to the cited 8 x H100
        // inter-token latency (README).
        step_overhead: if count > 1 { 0.0044 } else { 0.0003 },
    }
}

/// Names `--profile` accepts.
pub const PROFILE_NAMES: [&str; 3] = [
    "llama-3.1-8b-h100",
    "llama-3.1-70b-h100-tp8",
    "llama-3.1-8b-a100-40gb",
];

impl Profile {
    /// The named profile, if there is one.
    pub fn named(name: &str) -> Option<Profile> {
        let (model, gpu, max_model_len, kv_cache_blocks) = match name {
            // 80 GB - 16 GB of weights - activations, at 128 KiB of KV per token: ~55 GB of KV.
            "llama-3.1-8b-h100" => (LLAMA_31_8B, h100_sxm(1), 131_072, 26_000),
            // 640 GB - 141 GB of weights - activations, at 320 KiB of KV per token.
            "llama-3.1-70b-h100-tp8" => (LLAMA_31_70B, h100_sxm(8), 131_072, 90_000),
            // 40 GB - 16 GB of weights - activations.
            "llama-3.1-8b-a100-40gb" => (LLAMA_31_8B, a100_40gb(1), 131_072, 9_000),
            _ => return None,
        };
        Some(Profile {
            name: name.to_owned(),
            model,
            gpu,
            max_model_len,
            kv_cache_blocks,
        })
    }

    /// Simulated seconds one step over `batch` takes; zero for an empty batch.
    pub fn step_seconds(&self, batch: &[Work]) -> f64 {
        if batch.is_empty() {
            return 0.0;
        }
        let m = &self.model;
        let g = &self.gpu;
        let mut tokens = 0.0;
        let mut pairs = 0.0;
        let mut kv_tokens = 0.0;
        for w in batch {
            let n = f64::from(w.new_tokens);
            let ctx = f64::from(w.context);
            tokens += n;
            // Causal attention: each new token attends to the context and to the new tokens before it.
            pairs += n * (ctx + (n + 1.0) / 2.0);
            kv_tokens += ctx + n;
        }
        let flops =
            2.0 * m.params * tokens + 4.0 * f64::from(m.layers) * f64::from(m.hidden) * pairs;
        let bytes = m.params * m.bytes_per_param + m.kv_bytes_per_token() * kv_tokens;
        let gpus = f64::from(g.count.max(1));
        let compute = flops / (gpus * g.peak_flops * g.compute_efficiency);
        let memory = bytes / (gpus * g.hbm_bandwidth * g.memory_efficiency);
        compute.max(memory) + g.step_overhead
    }

    /// Time to first token of one prompt alone on the engine, simulated seconds, chunked into
    /// steps of at most `chunk` tokens.
    pub fn prefill_seconds(&self, prompt: u32, chunk: u32) -> f64 {
        let chunk = chunk.max(1);
        let mut done = 0;
        let mut t = 0.0;
        while done < prompt {
            let n = chunk.min(prompt - done);
            t += self.step_seconds(&[Work {
                new_tokens: n,
                context: done,
            }]);
            done += n;
        }
        t
    }

    /// One decode step of `batch` requests that each hold `context` tokens, simulated seconds.
    pub fn decode_step_seconds(&self, batch: u32, context: u32) -> f64 {
        let w = Work {
            new_tokens: 1,
            context,
        };
        self.step_seconds(&vec![w; batch as usize])
    }
}

/// `--profile` given a name no profile has.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown profile {0:?}; valid: {names}", names = PROFILE_NAMES.join(", "))]
pub struct UnknownProfile(pub String);

impl FromStr for Profile {
    type Err = UnknownProfile;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Profile::named(s.trim()).ok_or_else(|| UnknownProfile(s.to_owned()))
    }
}

impl fmt::Display for Profile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_resolves_and_unknown_is_refused() {
        for n in PROFILE_NAMES {
            assert_eq!(Profile::named(n).map(|p| p.name), Some(n.to_owned()));
        }
        let e = "gpt-5".parse::<Profile>().unwrap_err();
        assert!(e.to_string().contains("llama-3.1-8b-h100"), "{e}");
    }

    #[test]
    fn prefill_grows_with_tokens_and_context_decode_with_batch() {
        let p = Profile::named("llama-3.1-8b-h100").unwrap();
        assert_eq!(p.step_seconds(&[]), 0.0);
        let short = p.prefill_seconds(1024, 8192);
        let long = p.prefill_seconds(8192, 8192);
        // Linear terms alone would give 8x; attention over the context makes it more.
        assert!(long > 8.0 * (short - p.gpu.step_overhead), "{short} {long}");
        let chunked = p.prefill_seconds(8192, 2048);
        assert!(
            chunked > long,
            "chunking pays the weights and overhead per chunk"
        );
        let d1 = p.decode_step_seconds(1, 1024);
        let d64 = p.decode_step_seconds(64, 1024);
        assert!(d64 > d1 && d64 < 4.0 * d1, "{d1} {d64}");
        let deep = p.decode_step_seconds(64, 16_384);
        assert!(deep > d64, "KV read grows with context");
    }

    /// Output tokens per simulated second of `vllm bench serve --max-concurrency c` with fixed
    /// `input`/`output` lengths, in steady state: every request restarts once per `output`
    /// steps, so `c` of those steps also run a whole prompt (it fits one chunk) beside the
    /// other requests' decodes.
    fn closed_loop_throughput(p: &Profile, c: u32, input: u32, output: u32) -> f64 {
        let ctx = input + output / 2;
        let decode = Work {
            new_tokens: 1,
            context: ctx,
        };
        let mut mixed = vec![decode; c as usize - 1];
        mixed.push(Work {
            new_tokens: input,
            context: 0,
        });
        let cycle = f64::from(output - c) * p.decode_step_seconds(c, ctx)
            + f64::from(c) * p.step_seconds(&mixed);
        f64::from(c * output) / cycle
    }

    fn within(got: f64, cited: f64, what: &str) {
        assert!(
            (got / cited - 1.0).abs() <= 0.15,
            "{what}: model {got:.4}, cited {cited:.4}"
        );
    }

    /// Cited in the README ("Step-loop engines", calibration): vLLM 0.23 serving
    /// Llama-3.1-8B-Instruct on one A100 40GB, 1024-token prompts, 128 output tokens:
    /// 75 tokens/s (13.3 ms per token) at concurrency 1, 6.6x that throughput at concurrency 8.
    #[test]
    fn a100_profile_reproduces_its_cited_latency_and_batching_gain() {
        let p = Profile::named("llama-3.1-8b-a100-40gb").unwrap();
        within(
            p.decode_step_seconds(1, 1024 + 64),
            0.0133,
            "ITL at batch 1",
        );
        let one = closed_loop_throughput(&p, 1, 1024, 128);
        let eight = closed_loop_throughput(&p, 8, 1024, 128);
        within(eight / one, 6.6, "throughput gain at concurrency 8");
    }

    /// Cited in the README ("Step-loop engines", calibration): LambdaLabsML/vllm-benchmark's
    /// `results/prompt_10` runs of Llama 3 8B Instruct on one H100 SXM and Llama 3 70B Instruct
    /// on eight (tensor parallel), BF16, 10 ShareGPT prompts sent at once: the inter-token latency
    /// of the longest request (29 prompt tokens, 741 generated) while five others decode beside
    /// it and once it decodes alone. Contexts stay under 800 tokens, so the weights dominate.
    #[test]
    fn h100_profiles_reproduce_their_cited_inter_token_latency_vs_batch() {
        // (profile, ITL beside five others, ITL alone), seconds.
        for (name, six, alone) in [
            ("llama-3.1-8b-h100", 0.00739, 0.00706),
            ("llama-3.1-70b-h100-tp8", 0.01194, 0.01124),
        ] {
            let p = Profile::named(name).unwrap();
            within(
                p.decode_step_seconds(6, 29 + 100),
                six,
                &format!("{name}: ITL at batch 6"),
            );
            within(
                p.decode_step_seconds(1, 29 + 600),
                alone,
                &format!("{name}: ITL at batch 1"),
            );
        }
    }
}
