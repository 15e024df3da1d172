//! The table of every scalar key: the one source of the flags, their help, and the docs check.

/// A key of the configuration file: its section (a documentation group, also accepted as a
/// prefix by `--set`), its name, and the help shown by `--help`.
#[derive(Clone, Copy, Debug)]
pub struct Key {
    /// `http`, `legs`, `policy`, `health`, `limits`, `pool`, `discovery`, `shutdown`,
    /// `security`.
    pub section: &'static str,
    /// The key, as written in the file (inside `[section]` when `in_table`).
    pub name: &'static str,
    /// One line of help.
    pub help: &'static str,
    /// Whether the key lives in the file's `[section]` table (newer keys) rather than at the
    /// top level (the keys operators' files already use, which keep their place).
    pub in_table: bool,
    /// Whether a flag's value is always text (keys with no default to take the type from:
    /// `engine_api_key = "123"` stays a string).
    pub text: bool,
}

const fn key(section: &'static str, name: &'static str, help: &'static str) -> Key {
    Key {
        section,
        name,
        help,
        in_table: false,
        text: false,
    }
}

/// A key inside the file's `[section]` table.
const fn key_in(section: &'static str, name: &'static str, help: &'static str) -> Key {
    Key {
        in_table: true,
        ..key(section, name, help)
    }
}

impl Key {
    /// The same key, whose flag value is always text.
    const fn text(self) -> Key {
        Key { text: true, ..self }
    }

    /// The key's dotted path in the file: `max_in_flight`, `security.request_body_timeout`.
    pub fn path(&self) -> String {
        if self.in_table {
            format!("{}.{}", self.section, self.name)
        } else {
            self.name.to_string()
        }
    }
}

/// Every scalar key, with a flag each. (`prefill`, `decode`, `models` and `[kubernetes]` have
/// their own flags below.) A test checks this list against [`Config`]'s keys.
pub const KEYS: &[Key] = &[
    key("http", "listen", "Address to serve on"),
    key(
        "http",
        "client_idle_timeout",
        "A client connection without a request head for this long is closed",
    ),
    key(
        "http",
        "access_log",
        "One log line per finished request at info (target pdgate::access): request id, route, status, outcome, model, connector, endpoints, total and first-byte times",
    ),
    key(
        "http",
        "max_body_bytes",
        "Largest accepted request body in bytes",
    ),
    key(
        "discovery",
        "kv_connector",
        "Global default KV connector for endpoints without a `model.aibrix.ai/kv-connector-type` label (shfs, nixl, mooncake, sglang)",
    ),
    key(
        "discovery",
        "discovery",
        "Endpoint discovery: static or kubernetes",
    ),
    key(
        "discovery",
        "bootstrap_port",
        "Bootstrap port of static prefill endpoints that set none (Mooncake /query, SGLang bootstrap server; engines default to 8998)",
    ),
    key(
        "discovery",
        "bootstrap_refresh",
        "How often bootstrap (/query) answers are refreshed",
    ),
    key(
        "policy",
        "prefill_policy",
        "Prefill policy: round_robin, random, least_request, power_of_two, cache_aware",
    ),
    key(
        "policy",
        "decode_policy",
        "Decode policy: round_robin, random, least_request, power_of_two, cache_aware",
    ),
    key("legs", "prefill_timeout", "Bound on the whole prefill leg"),
    key(
        "legs",
        "decode_timeout",
        "Bound on waiting for the decode response head",
    ),
    key(
        "legs",
        "stream_idle_timeout",
        "Bound on silence between two relayed chunks",
    ),
    key(
        "legs",
        "on_prefill_failure",
        "When the prefill fails (5xx, transport error, timeout): `fallback` sends the request to the decode alone and marks the response `x-pdgate-fallback`; `fail` answers the error",
    ),
    key(
        "legs",
        "max_retries",
        "Retries of a failed leg on another endpoint; 0 disables",
    ),
    key(
        "legs",
        "encode_timeout",
        "Bound on each encoder leg (encoder disaggregation)",
    ),
    key(
        "legs",
        "encode_max_items",
        "Most multimodal items of one request sent to encoders; more is a 400 (with encoders in the fleet)",
    ),
    key(
        "legs",
        "on_encode_failure",
        "When no encoder could encode an item (5xx, transport error, timeout): `fail` answers the error; `fallback` sends the prefill the request without encoder parameters (it encodes the items itself)",
    ),
    key(
        "pool",
        "connect_timeout",
        "Bound on connecting to an engine",
    ),
    key(
        "pool",
        "pool_max_idle_per_engine",
        "Idle connections kept per engine for reuse",
    ),
    key(
        "pool",
        "pool_idle_timeout",
        "An idle engine connection older than this is closed",
    ),
    key(
        "health",
        "health_checks",
        "Active health checks of every endpoint: true or false",
    ),
    key(
        "health",
        "health_check_interval",
        "Time between two active checks of one endpoint",
    ),
    key(
        "health",
        "health_check_timeout",
        "Bound on one active check",
    ),
    key(
        "health",
        "unhealthy_threshold",
        "Consecutive failed checks that make an endpoint unhealthy",
    ),
    key(
        "health",
        "healthy_threshold",
        "Consecutive passed checks that make it healthy again",
    ),
    key(
        "health",
        "outlier_consecutive_failures",
        "Consecutive failures on real traffic that eject an endpoint; 0 disables",
    ),
    key(
        "health",
        "outlier_error_rate",
        "Share of failed requests within one outlier interval that ejects an endpoint; 0 disables",
    ),
    key(
        "health",
        "outlier_min_requests",
        "Requests needed within the interval before the error rate counts",
    ),
    key(
        "health",
        "outlier_interval",
        "Window of the error-rate detection",
    ),
    key(
        "health",
        "outlier_base_ejection",
        "First ejection period, doubled on each repeat",
    ),
    key("health", "outlier_max_ejection", "Longest ejection period"),
    key(
        "limits",
        "retry_budget_ratio",
        "Retries per request allowed on average",
    ),
    key(
        "limits",
        "retry_budget_min",
        "Retry tokens available at start and minimum bucket size",
    ),
    key(
        "limits",
        "retry_budget_window",
        "The retry bucket holds retry_budget_ratio times the requests of the last window",
    ),
    key(
        "limits",
        "max_in_flight",
        "Requests served at once; 0 means unlimited",
    ),
    key(
        "limits",
        "max_queue",
        "Requests waiting beyond max-in-flight; more are refused with 429",
    ),
    key(
        "limits",
        "queue_timeout",
        "Longest wait in the queue before a 429",
    ),
    key(
        "limits",
        "max_in_flight_per_endpoint",
        "Requests one endpoint holds at once; 0 means unlimited",
    ),
    key(
        "shutdown",
        "drain_delay",
        "After SIGTERM, time /ready answers 503 before the listener closes",
    ),
    key(
        "shutdown",
        "shutdown_timeout",
        "Bound on waiting for in-flight requests after the listener closes",
    ),
    key_in(
        "security",
        "request_body_timeout",
        "A request body must be read completely within this long of its head (408 otherwise)",
    ),
    key_in(
        "security",
        "max_buffered_body_bytes",
        "Total bytes of request bodies being read at once; 0 means unbounded",
    ),
    key_in(
        "security",
        "body_budget_wait",
        "How long a body waits for room in max-buffered-body-bytes before a 503",
    ),
    key_in(
        "security",
        "max_streams_per_connection",
        "HTTP/2 streams one client connection may have open at once",
    ),
    key_in(
        "security",
        "api_keys_file",
        "A file of client API keys, one per line, re-read when it changes",
    ).text(),
    key_in(
        "security",
        "reload_interval",
        "How often api-keys-file and the TLS files are checked for changes",
    ),
    key_in(
        "security",
        "tls_cert",
        "Serve HTTPS with this certificate chain (PEM; with tls-key), re-read when it changes",
    )
    .text(),
    key_in(
        "security",
        "tls_key",
        "The private key (PEM) of tls-cert, re-read when it changes",
    )
    .text(),
    key_in(
        "security",
        "engine_ca_file",
        "CA certificates (PEM) that https:// engines are verified against (default: the system's roots)",
    )
    .text(),
    key_in(
        "security",
        "engine_client_cert",
        "A client certificate (PEM) presented to https:// engines (mTLS; with engine-client-key)",
    )
    .text(),
    key_in(
        "security",
        "engine_client_key",
        "The private key (PEM) of engine-client-cert",
    )
    .text(),
    key_in(
        "security",
        "engine_api_key",
        "The engines' API key, sent to them as the bearer token",
    ).text(),
    key_in(
        "security",
        "forward_client_authorization",
        "Forward the client's Authorization header to engines (unset: only when neither client keys nor an engine key are configured)",
    ),
    key_in(
        "security",
        "expose_target_headers",
        "Name the serving endpoints in answers (prefill-target-pod, target-pod)",
    ),
    key_in(
        "security",
        "admin_listen",
        "Serve /metrics, /health and /ready on this address; /metrics leaves the API port",
    ).text(),
    key_in(
        "telemetry",
        "otlp_endpoint",
        "Export traces to this OTLP collector (http://host:4318 for http/protobuf, http://host:4317 for grpc); unset: no export",
    )
    .text(),
    key_in(
        "telemetry",
        "otlp_protocol",
        "OTLP transport: http/protobuf or grpc",
    )
    .text(),
    key_in(
        "telemetry",
        "otlp_service_name",
        "The service.name of exported spans",
    )
    .text(),
    key_in(
        "telemetry",
        "otlp_sample_ratio",
        "Share of new traces sampled, 0 to 1 (a client's traceparent decides for its own trace)",
    ),
    key_in(
        "telemetry",
        "otlp_queue_size",
        "Finished spans waiting for export; more are dropped and counted (pdgate_otel_spans_dropped_total)",
    ),
    key_in(
        "telemetry",
        "otlp_export_timeout",
        "Bound on one export call, and on the flush at shutdown",
    ),
];
