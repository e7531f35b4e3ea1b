// Anthropic's TypeScript SDK at its defaults (endpoint and key from ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY):
// `client.beta.messages.toolRunner` runs its loop over a message thread, a `create` then `continue`s that send only
// the new messages, without `system` and `tools`. A tool forced by `tool_choice: any`, three turns; each attempt
// on its own rollout (`ROLLOUT_ID`-`seed`). Prints each request's `thread` and whether it carried `tools`.
import Anthropic from "@anthropic-ai/sdk";
import { betaZodTool } from "@anthropic-ai/sdk/helpers/beta/zod";
import { z } from "zod";

let sent = [];
const recordingFetch = async (url, init) => {
  const body = JSON.parse(init.body);
  sent.push({ thread: body.thread ?? null, tools: "tools" in body });
  return fetch(url, init);
};
const getWeather = betaZodTool({
  name: "get_weather",
  description: "Current weather of a city.",
  inputSchema: z.object({ city: z.enum(["Paris", "Rome"]) }),
  run: async () => "sunny",
});
const failures = [];
for (let seed = 0; seed < 8; seed++) { // a random-weight model may pad the JSON past the token limit on a seed
  sent = [];
  const client = new Anthropic({
    fetch: recordingFetch,
    maxRetries: 0,
    defaultHeaders: { "X-ART-Rollout-Id": `${process.env.ROLLOUT_ID}-${seed}` },
  });
  try {
    const runner = client.beta.messages.toolRunner({
      model: "my-agent",
      max_tokens: 48,
      system: "You check the weather.",
      messages: [{ role: "user", content: "What is the weather in Rome and in Paris?" }],
      tools: [getWeather],
      tool_choice: { type: "any" },
      max_iterations: 3,
      seed,
    });
    const replies = [];
    for await (const message of runner) replies.push(message);
    const stops = replies.map((reply) => reply.stop_reason);
    if (stops.every((stop) => stop === "tool_use")) {
      console.log(JSON.stringify({ seed, ids: replies.map((reply) => reply.id), sent, failures }));
      process.exit(0);
    }
    failures.push(`seed ${seed}: not every reply a whole tool call (${stops})`);
  } catch (error) {
    failures.push(`seed ${seed}: ${error.name}: ${String(error.message).slice(0, 300)}`);
  }
}
console.error(failures.join("\n"));
process.exit(1);
