-- wrk script: small non-streaming completion (pdsim throughput measurement)
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"pdsim","prompt":"Say hello to the world in five words","max_tokens":8}'
