// The OpenAI Agents SDK for JavaScript at its defaults (the Responses API) with a tool, forced on the first turn.
import { Agent, OpenAIProvider, Runner, setTracingDisabled, tool } from "@openai/agents";
import { z } from "zod";

setTracingDisabled(true); // traces would go to OpenAI's servers
const asked = [];
const getWeather = tool({
  name: "get_weather",
  description: "Current weather of a city",
  parameters: z.object({ city: z.enum(["Paris", "Rome"]) }),
  execute: async ({ city }) => {
    asked.push(city);
    return "sunny";
  },
});
const failures = [];
for (let seed = 0; seed < 8; seed++) { // a random-weight model may pad the JSON past the token limit on a seed
  // One provider per run: the SDK keeps the first client it is given (docs/clients.md).
  const runner = new Runner({
    modelProvider: new OpenAIProvider({ baseURL: process.env.OPENAI_BASE_URL, apiKey: "unused" }),
    tracingDisabled: true,
  });
  const agent = new Agent({
    name: "weather",
    instructions: "You answer briefly.",
    model: "my-agent",
    tools: [getWeather],
    modelSettings: { toolChoice: "required", maxTokens: 48, providerData: { seed } },
  });
  try {
    const result = await runner.run(agent, "What is the weather?", { maxTurns: 3 });
    if (asked.length > 0) {
      console.log(JSON.stringify({ asked, final: String(result.finalOutput ?? ""), failures }));
      process.exit(0);
    }
    failures.push(`seed ${seed}: no tool call`);
  } catch (error) {
    if (asked.length > 0) { // the tool was called; the run may end past its turns on a random model
      console.log(JSON.stringify({ asked, final: "", failures }));
      process.exit(0);
    }
    failures.push(`seed ${seed}: ${error.name}: ${String(error.message).slice(0, 300)}`);
  }
}
console.error(failures.join("\n"));
process.exit(1);
