#!/usr/bin/env node
// Streams one generation from llmserve's public API (llmserve.v1.Generation) with
// @grpc/grpc-js, loading the service definition straight from protos/ with @grpc/proto-loader
// (no code generation step).
//
//   node generate.mjs --chat "Write a haiku about the sea" --max-tokens 48
//   node generate.mjs "The capital of France is" --max-tokens 16
//   node generate.mjs --ids 1,9690,28 --max-tokens 8 --ignore-eos
//   node generate.mjs --info                          # model and limits only
//   LLMSERVE_ADDRESS=10.0.0.7:50051 node generate.mjs "Hello"
//
// Text goes to stdout as it arrives; the summary line (finish reason, token counts) and errors
// go to stderr. A failed call prints its gRPC status and exits with 1 (2 for bad usage).

import path from "node:path";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";

import grpc from "@grpc/grpc-js";
import protoLoader from "@grpc/proto-loader";

const HERE = path.dirname(fileURLToPath(import.meta.url));
const PROTO_ROOT = path.resolve(HERE, "..", "..", "protos");

const USAGE = `usage: node generate.mjs [PROMPT...] [options]

  --address HOST:PORT   server (default: $LLMSERVE_ADDRESS or 127.0.0.1:50051)
  --chat                send PROMPT as a user message, rendered with the model's chat template
  --ids 1,2,3           pre-tokenized prompt instead of PROMPT
  --max-tokens N        most tokens to generate (default 64; 0 = until eos or the context is full)
  --temperature T       0 = greedy (default 0)
  --top-p P, --top-k K  nucleus / top-k sampling
  --seed S              sampling seed
  --stop STR            stop string (repeatable)
  --ignore-eos          keep generating past end-of-sequence tokens
  --request-id ID       your id for the request
  --timeout SECONDS     deadline of each call (default: none)
  --info                print GetModelInfo first (alone when there is no prompt)
  --tokenize            print the prompt's token ids (Tokenize) instead of generating
  -h, --help            this text`;

function parseCli(argv) {
  const { values, positionals } = parseArgs({
    args: argv,
    allowPositionals: true,
    options: {
      address: { type: "string" },
      chat: { type: "boolean", default: false },
      ids: { type: "string" },
      "max-tokens": { type: "string", default: "64" },
      temperature: { type: "string", default: "0" },
      "top-p": { type: "string", default: "0" },
      "top-k": { type: "string", default: "0" },
      seed: { type: "string" },
      stop: { type: "string", multiple: true, default: [] },
      "ignore-eos": { type: "boolean", default: false },
      "request-id": { type: "string", default: "" },
      timeout: { type: "string" },
      info: { type: "boolean", default: false },
      tokenize: { type: "boolean", default: false },
      help: { type: "boolean", short: "h", default: false },
    },
  });
  const number = (name, { integer = false } = {}) => {
    const value = Number(values[name]);
    if (!Number.isFinite(value) || value < 0 || (integer && !Number.isInteger(value))) {
      throw new Error(`--${name} must be a non-negative ${integer ? "integer" : "number"}, got ${values[name]}`);
    }
    return value;
  };
  const ids = values.ids === undefined ? [] : values.ids.split(",").map((s) => {
    const id = Number(s.trim());
    if (!Number.isInteger(id) || id < 0) throw new Error(`--ids: not a token id: ${JSON.stringify(s)}`);
    return id;
  });
  return {
    help: values.help,
    address: values.address ?? process.env.LLMSERVE_ADDRESS ?? "127.0.0.1:50051",
    prompt: positionals.join(" "),
    chat: values.chat,
    ids,
    maxTokens: number("max-tokens", { integer: true }),
    temperature: number("temperature"),
    topP: number("top-p"),
    topK: number("top-k", { integer: true }),
    // uint64 travels as a decimal string so that seeds above 2**53 survive.
    seed: values.seed === undefined ? undefined : String(BigInt(values.seed)),
    stop: values.stop,
    ignoreEos: values["ignore-eos"],
    requestId: values["request-id"],
    timeoutS: values.timeout === undefined ? undefined : number("timeout"),
    info: values.info,
    tokenize: values.tokenize,
  };
}

function loadGenerationService() {
  const definition = protoLoader.loadSync("llmserve/v1/generation.proto", {
    includeDirs: [PROTO_ROOT],
    keepCase: true, // field names exactly as in the .proto (prompt_token_ids, finish_reason)
    longs: String, // uint64 fields (seed, swapped_bytes) as decimal strings
    enums: String, // finish_reason as "FINISH_REASON_LENGTH"
    defaults: true, // unset scalars read as 0 / "" / [] like in every other proto runtime
  });
  return grpc.loadPackageDefinition(definition).llmserve.v1.Generation;
}

function callOptions(opts) {
  return opts.timeoutS === undefined ? {} : { deadline: new Date(Date.now() + opts.timeoutS * 1000) };
}

// Promise wrapper for unary calls: resolves with the response, rejects with the ServiceError.
function unary(client, method, request, opts) {
  return new Promise((resolve, reject) => {
    client[method](request, callOptions(opts), (error, response) => (error ? reject(error) : resolve(response)));
  });
}

function generate(client, opts) {
  const sampling = { temperature: opts.temperature, top_p: opts.topP, top_k: opts.topK };
  if (opts.seed !== undefined) sampling.seed = opts.seed;
  // Exactly one of prompt, prompt_token_ids and messages is set.
  const request = {
    request_id: opts.requestId,
    prompt: opts.ids.length || opts.chat ? "" : opts.prompt,
    prompt_token_ids: opts.ids,
    messages: opts.chat && !opts.ids.length ? [{ role: "user", content: opts.prompt }] : [],
    sampling,
    stopping: { max_tokens: opts.maxTokens, stop: opts.stop, ignore_eos: opts.ignoreEos },
  };
  return new Promise((resolve, reject) => {
    const call = client.Generate(request, callOptions(opts));
    // Cancelling the call aborts the request on the server and frees its KV blocks.
    const onSigint = () => call.cancel();
    process.once("SIGINT", onSigint);
    let last = null;
    call.on("data", (message) => {
      last = message;
      process.stdout.write(message.text);
    });
    call.on("error", (error) => {
      process.removeListener("SIGINT", onSigint);
      process.stdout.write("\n");
      reject(error);
    });
    call.on("end", () => {
      process.removeListener("SIGINT", onSigint);
      process.stdout.write("\n");
      resolve(last);
    });
  });
}

function summary(last) {
  if (last === null) return "[no messages]";
  const reason = last.finish_reason.replace(/^FINISH_REASON_/, "").toLowerCase();
  return `[finish: ${reason}, prompt_tokens: ${last.prompt_tokens}, completion_tokens: ${last.completion_tokens}, request_id: ${last.request_id}]`;
}

async function main() {
  let opts;
  try {
    opts = parseCli(process.argv.slice(2));
  } catch (error) {
    console.error(`${error.message}\n\n${USAGE}`);
    return 2;
  }
  if (opts.help) {
    console.log(USAGE);
    return 0;
  }
  const hasPrompt = opts.prompt !== "" || opts.ids.length > 0;
  if (!hasPrompt && !opts.info) {
    console.error(`a prompt (or --ids, or --info) is required\n\n${USAGE}`);
    return 2;
  }

  const Generation = loadGenerationService();
  const client = new Generation(opts.address, grpc.credentials.createInsecure());
  try {
    if (opts.info) {
      console.log(JSON.stringify(await unary(client, "GetModelInfo", {}, opts), null, 2));
    }
    if (!hasPrompt) return 0;
    if (opts.tokenize) {
      const tokens = await unary(client, "Tokenize", { text: opts.prompt }, opts);
      console.log(JSON.stringify(tokens));
      return 0;
    }
    const last = await generate(client, opts);
    console.error(summary(last));
    return 0;
  } catch (error) {
    // A grpc-js ServiceError: code is a number, grpc.status maps it back to its name.
    const name = grpc.status[error.code] ?? "UNKNOWN";
    console.error(`error: ${name} (${error.code}): ${error.details ?? error.message}`);
    return 1;
  } finally {
    client.close();
  }
}

process.exitCode = await main();
