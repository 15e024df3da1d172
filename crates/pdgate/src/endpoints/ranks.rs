//! Data-parallel ranks as routing targets.
//!
//! One engine endpoint may front N data-parallel ranks (vLLM `--data-parallel-size`, SGLang's
//! data-parallel controller), each with its own KV cache and queue. A pod declares N with the
//! [`DATA_PARALLEL_SIZE_ANNOTATION`] (the static endpoint's `data_parallel_size`); the snapshot
//! then holds one endpoint per rank, named by [`rank_name`], and every leg to it carries
//! `X-data-parallel-rank`, so load, passive health and cache-aware decisions are per rank. Pure.

use kvtransfer::Pod;

/// Pod annotation (and static endpoint `data_parallel_size`): how many data-parallel ranks the
/// engine serves. Absent or 1: one routing target, no rank header. Kubernetes discovery passes
/// it on from the pod.
pub const DATA_PARALLEL_SIZE_ANNOTATION: &str = pdkube::config::DATA_PARALLEL_SIZE_ANNOTATION;

/// The largest data-parallel size accepted (wide expert-parallel deployments run 32 to 256
/// ranks per endpoint; more is a typo).
pub const MAX_DATA_PARALLEL_SIZE: u32 = 1024;

/// The routing targets of `pod`: `(name, rank)` per data-parallel rank, or the pod itself
/// (`rank` `None`) when it declares one rank or none. An annotation that is not a number in
/// `1..=MAX_DATA_PARALLEL_SIZE` is the error, as the reason the pod is left out.
pub fn targets(pod: &Pod) -> Result<Vec<(String, Option<u32>)>, String> {
    let size = size(pod)?;
    if size == 1 {
        return Ok(vec![(pod.name.clone(), None)]);
    }
    Ok((0..size)
        .map(|r| (rank_name(&pod.name, r), Some(r)))
        .collect())
}

/// The declared data-parallel size of `pod` (1 without the annotation).
pub fn size(pod: &Pod) -> Result<u32, String> {
    let Some(v) = pod.annotation(DATA_PARALLEL_SIZE_ANNOTATION) else {
        return Ok(1);
    };
    match v.trim().parse::<u32>() {
        Ok(n) if (1..=MAX_DATA_PARALLEL_SIZE).contains(&n) => Ok(n),
        _ => Err(format!(
            "{DATA_PARALLEL_SIZE_ANNOTATION}={v:?} is not a number in 1..={MAX_DATA_PARALLEL_SIZE}"
        )),
    }
}

/// The name of rank `rank` of the engine named `engine`: in logs, response headers, health and
/// load tables.
pub fn rank_name(engine: &str, rank: u32) -> String {
    format!("{engine}#dp{rank}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(size: Option<&str>) -> Pod {
        let mut pod = Pod::new("10.0.0.1:8000", "10.0.0.1", 8000);
        if let Some(s) = size {
            pod.annotations
                .insert(DATA_PARALLEL_SIZE_ANNOTATION.into(), s.into());
        }
        pod
    }

    #[test]
    fn a_pod_is_one_target_per_rank() {
        assert_eq!(
            targets(&pod(None)),
            Ok(vec![("10.0.0.1:8000".into(), None)])
        );
        assert_eq!(
            targets(&pod(Some("1"))),
            Ok(vec![("10.0.0.1:8000".into(), None)])
        );
        let four = targets(&pod(Some(" 4 "))).expect("four ranks");
        assert_eq!(four.len(), 4);
        assert_eq!(four[3], ("10.0.0.1:8000#dp3".into(), Some(3)));
        for bad in ["0", "-2", "four", "", "1025"] {
            let err = targets(&pod(Some(bad))).expect_err(bad);
            assert!(err.contains(DATA_PARALLEL_SIZE_ANNOTATION), "{err}");
        }
    }
}
