//! A statically configured endpoint (`[[prefill]]`, `[[decode]]`, `[[encode]]`, `--prefill URL`)
//! as a pod.

use kvtransfer::Pod;

use super::{ConfigError, EndpointConfig, field_error};

/// Turns one configured endpoint into a pod the routing core understands.
pub(super) fn endpoint_pod(
    role: &str,
    index: usize,
    ep: &EndpointConfig,
    default_bootstrap_port: Option<u16>,
) -> Result<Pod, ConfigError> {
    let field = format!("{role}[{index}].url");
    let uri: http::Uri = ep
        .url
        .parse()
        .map_err(|e| field_error(&field, format!("{:?} is not a URL: {e}", ep.url)))?;
    let tls = match uri.scheme_str() {
        Some("http") => false,
        Some("https") => true,
        _ => {
            return Err(field_error(
                &field,
                format!("{:?} must start with http:// or https://", ep.url),
            ));
        }
    };
    let host = uri
        .host()
        .ok_or_else(|| field_error(&field, format!("{:?} has no host", ep.url)))?;
    if uri.path() != "/" && !uri.path().is_empty() {
        return Err(field_error(
            &field,
            format!("{:?} must be a base URL without a path", ep.url),
        ));
    }
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port = uri.port_u16().unwrap_or(if tls { 443 } else { 80 });
    let name = ep.name.clone().unwrap_or_else(|| {
        if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        }
    });
    let mut pod = Pod::new(name, host, port);
    pod.ready = true;
    pod.labels = ep.labels.clone();
    pod.annotations = ep.annotations.clone();
    if tls {
        pod.annotations.insert(
            crate::endpoints::ENGINE_SCHEME_ANNOTATION.to_string(),
            "https".to_string(),
        );
    }
    pod.labels
        .insert(kvtransfer::labels::ROLE_NAME.to_string(), role.to_string());
    if let Some(model) = &ep.model {
        pod.labels
            .insert(kvtransfer::labels::MODEL_NAME.to_string(), model.clone());
    }
    if let Some(key) = &ep.api_key {
        // Carried to the endpoint, which keeps it as a sensitive header value only.
        pod.annotations.insert(
            crate::endpoints::ENGINE_KEY_ANNOTATION.to_string(),
            key.0.clone(),
        );
    }
    if let Some(port) = ep.bootstrap_port.or(default_bootstrap_port) {
        for key in kvtransfer::labels::BOOTSTRAP_PORTS {
            pod.annotations.insert(key.to_string(), port.to_string());
        }
    }
    if let Some(size) = ep.data_parallel_size {
        use crate::endpoints::ranks::{DATA_PARALLEL_SIZE_ANNOTATION, MAX_DATA_PARALLEL_SIZE};
        if !(1..=MAX_DATA_PARALLEL_SIZE).contains(&size) {
            return Err(field_error(
                format!("{role}[{index}].data_parallel_size"),
                format!("{size} is not in 1..={MAX_DATA_PARALLEL_SIZE}"),
            ));
        }
        pod.annotations
            .insert(DATA_PARALLEL_SIZE_ANNOTATION.to_string(), size.to_string());
    }
    for (key, v) in [
        (crate::cache::KV_EVENTS_ANNOTATION, &ep.kv_events),
        (
            crate::cache::KV_EVENTS_REPLAY_ANNOTATION,
            &ep.kv_events_replay,
        ),
    ] {
        if let Some(v) = v {
            pod.annotations.insert(key.to_string(), v.clone());
        }
    }
    Ok(pod)
}
