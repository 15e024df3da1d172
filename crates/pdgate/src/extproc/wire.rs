//! Envoy's ext_proc messages to and from what the gateway works with: header maps, the
//! destination a proxy reads (headers and `envoy.lb` metadata), the subset hint, mutations and
//! immediate responses.

use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap as ProtoHeaders, HeaderValue as ProtoHeader, HeaderValueOption, Metadata,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse,
    ProcessingResponse, body_mutation, processing_response,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value, value};
use http::header::{HeaderMap, HeaderName, HeaderValue};

/// The header naming the endpoint the proxy is to send the request to (Gateway API Inference
/// Extension), and the key of the same value in the `envoy.lb` metadata namespace.
pub(crate) const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The metadata namespace a proxy's load balancer reads the destination from.
pub(crate) const LB_NAMESPACE: &str = "envoy.lb";
/// The metadata namespace of the proxy's subset hint.
pub(crate) const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The subset hint's key (metadata) and header: the endpoints the proxy can send to.
pub(crate) const SUBSET: &str = "x-gateway-destination-endpoint-subset";
/// llm-d's header naming the prefill for the sidecar on the decode pod.
pub(crate) const PREFILLER: &str = "x-prefiller-host-port";

/// The pseudo-headers of a request or response head.
#[derive(Debug, Default)]
pub(crate) struct Pseudo {
    pub(crate) method: Option<String>,
    pub(crate) path: Option<String>,
    pub(crate) status: Option<u16>,
}

/// A proto header map as an HTTP header map plus its pseudo-headers. Envoy sends values in
/// `raw_value` (older releases in `value`); a name or value HTTP does not allow is left out.
pub(crate) fn headers(proto: Option<&ProtoHeaders>) -> (HeaderMap, Pseudo) {
    let mut out = HeaderMap::new();
    let mut pseudo = Pseudo::default();
    for h in proto.map_or(&[][..], |p| p.headers.as_slice()) {
        let raw = if h.raw_value.is_empty() {
            h.value.as_bytes()
        } else {
            h.raw_value.as_slice()
        };
        match h.key.as_str() {
            ":method" => pseudo.method = std::str::from_utf8(raw).ok().map(str::to_string),
            ":path" => pseudo.path = std::str::from_utf8(raw).ok().map(str::to_string),
            ":status" => {
                pseudo.status = std::str::from_utf8(raw).ok().and_then(|s| s.parse().ok());
            }
            key if key.starts_with(':') => {}
            key => {
                if let (Ok(name), Ok(value)) =
                    (HeaderName::try_from(key), HeaderValue::from_bytes(raw))
                {
                    out.append(name, value);
                }
            }
        }
    }
    (out, pseudo)
}

/// The endpoints a subset hint names: the `envoy.lb.subset_hint` metadata (a list of
/// `host:port`, or one comma-separated string), else the header of the same name. `None`: no
/// hint (every endpoint will do).
pub(crate) fn subset_hint(metadata: Option<&Metadata>, headers: &HeaderMap) -> Option<Vec<String>> {
    let split = |s: &str| -> Vec<String> {
        s.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect()
    };
    let from_metadata = metadata
        .and_then(|m| m.filter_metadata.get(SUBSET_NAMESPACE))
        .and_then(|s| s.fields.get(SUBSET))
        .and_then(|v| match &v.kind {
            Some(value::Kind::ListValue(list)) => Some(
                list.values
                    .iter()
                    .filter_map(|v| match &v.kind {
                        Some(value::Kind::StringValue(s)) => Some(split(s)),
                        _ => None,
                    })
                    .flatten()
                    .collect(),
            ),
            Some(value::Kind::StringValue(s)) => Some(split(s)),
            _ => None,
        });
    from_metadata.or_else(|| {
        let values: Vec<&HeaderValue> = headers.get_all(SUBSET).iter().collect();
        (!values.is_empty()).then(|| {
            values
                .into_iter()
                .filter_map(|v| v.to_str().ok())
                .flat_map(split)
                .collect()
        })
    })
}

/// One header to set, replacing any value the request has.
pub(crate) fn set(name: &str, value: &[u8]) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(ProtoHeader {
            key: name.to_string(),
            value: String::new(),
            raw_value: value.to_vec(),
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..HeaderValueOption::default()
    }
}

/// The header mutation that sets every header of `headers`.
pub(crate) fn set_all(headers: &HeaderMap) -> Vec<HeaderValueOption> {
    headers
        .iter()
        .map(|(k, v)| set(k.as_str(), v.as_bytes()))
        .collect()
}

/// The `envoy.lb` metadata naming `endpoint` as the destination.
pub(crate) fn destination_metadata(endpoint: &str) -> Struct {
    let string = |s: &str| Value {
        kind: Some(value::Kind::StringValue(s.to_string())),
    };
    let lb = Struct {
        fields: [(DESTINATION.to_string(), string(endpoint))].into(),
    };
    Struct {
        fields: [(
            LB_NAMESPACE.to_string(),
            Value {
                kind: Some(value::Kind::StructValue(lb)),
            },
        )]
        .into(),
    }
}

/// A subset hint as the proxy puts it in `envoy.lb.subset_hint` (tests and the client of the
/// tests build it this way).
pub fn subset_metadata(endpoints: &[&str]) -> Metadata {
    let list = ListValue {
        values: endpoints
            .iter()
            .map(|e| Value {
                kind: Some(value::Kind::StringValue((*e).to_string())),
            })
            .collect(),
    };
    let hint = Struct {
        fields: [(
            SUBSET.to_string(),
            Value {
                kind: Some(value::Kind::ListValue(list)),
            },
        )]
        .into(),
    };
    Metadata {
        filter_metadata: [(SUBSET_NAMESPACE.to_string(), hint)].into(),
        ..Metadata::default()
    }
}

/// A common response that continues with these mutations.
pub(crate) fn common(
    set_headers: Vec<HeaderValueOption>,
    remove_headers: Vec<String>,
    body: Option<Bytes>,
    clear_route_cache: bool,
) -> CommonResponse {
    let header_mutation =
        (!set_headers.is_empty() || !remove_headers.is_empty()).then_some(HeaderMutation {
            set_headers,
            remove_headers,
        });
    CommonResponse {
        header_mutation,
        body_mutation: body.map(|b| BodyMutation {
            mutation: Some(body_mutation::Mutation::Body(b.to_vec())),
        }),
        clear_route_cache,
        ..CommonResponse::default()
    }
}

/// The answer to a request-headers message.
pub(crate) fn request_headers(response: CommonResponse) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::RequestHeaders(
            HeadersResponse {
                response: Some(response),
            },
        )),
        ..ProcessingResponse::default()
    }
}

/// The answer to a response-headers message.
pub(crate) fn response_headers(response: CommonResponse) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::ResponseHeaders(
            HeadersResponse {
                response: Some(response),
            },
        )),
        ..ProcessingResponse::default()
    }
}

/// The answer to a request-body message, with the destination metadata when given.
pub(crate) fn request_body(
    response: CommonResponse,
    metadata: Option<Struct>,
) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::RequestBody(BodyResponse {
            response: Some(response),
        })),
        dynamic_metadata: metadata,
        ..ProcessingResponse::default()
    }
}

/// The answer to a response-body message.
pub(crate) fn response_body(response: CommonResponse) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::ResponseBody(BodyResponse {
            response: Some(response),
        })),
        ..ProcessingResponse::default()
    }
}

/// The answer to a trailers message: nothing to change.
pub(crate) fn trailers(request: bool) -> ProcessingResponse {
    use processing_response::Response;
    let t = envoy_types::pb::envoy::service::ext_proc::v3::TrailersResponse::default();
    ProcessingResponse {
        response: Some(if request {
            Response::RequestTrailers(t)
        } else {
            Response::ResponseTrailers(t)
        }),
        ..ProcessingResponse::default()
    }
}

/// An immediate response: the proxy answers the client with it (or, once the client has the
/// response head, resets the stream).
pub(crate) fn immediate(
    status: http::StatusCode,
    headers: &HeaderMap,
    body: Bytes,
    details: String,
) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::ImmediateResponse(
            ImmediateResponse {
                status: Some(HttpStatus {
                    code: i32::from(status.as_u16()),
                }),
                headers: Some(HeaderMutation {
                    set_headers: set_all(headers),
                    remove_headers: Vec::new(),
                }),
                body: body.to_vec(),
                grpc_status: None,
                details,
            },
        )),
        ..ProcessingResponse::default()
    }
}
